"""Sleep benchmark: the memory a sleep frees and the time from a wake to the next first token.

One engine (the torch backend) answers one warm-up question, and the same again (its prefix
then comes from the cache, as after a wake: a path used for the first time costs there, not
in the first wake), then per repeat and level:
the memory the process holds is read awake, the engine sleeps (level 1, then level 2),
the memory is read again, and a question is asked at once: its wake, vision, prefill and
first token, timed together, are "wake to first token". On a GPU the memory is the
device's (``torch.cuda`` allocator reserve, and the device's used memory, which also counts
the CUDA context and anything else on the device); on a CPU it is the process's RSS.

Where that time goes is recorded beside it, per question: the result's ``timings`` (wake, of
which capturing graphs again, vision, prefill, first token), its ``cache`` (prefix reused,
blocks restored), and what was built during it (:func:`build_counts`): graphs dynamo
compiled and the seconds it spent, graphs the decoder engine captured, whether the fused
step's tiles were tuned.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgeinfer.bench import raw
from edgeinfer.bench.common import bench_image, environment
from edgeinfer.bench.quiet import RunLog

QUESTION = "Describe this image."


@dataclass(frozen=True)
class SleepBenchSpec:
    model: Path
    profile: str = "cuda"
    overrides: tuple[str, ...] = ()
    image_size: tuple[int, int] = (1024, 768)
    repeats: int = 3
    levels: tuple[int, ...] = (1, 2)

    def __post_init__(self) -> None:
        if self.repeats < 1 or not self.levels or set(self.levels) - {1, 2}:
            raise ValueError(f"repeats must be >= 1 and levels 1 and/or 2, got {self.repeats} and {self.levels}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "model": str(self.model)}


def memory_held(device: str) -> dict[str, int]:
    """Bytes this process holds where the engine runs."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"allocator_reserved": torch.cuda.memory_reserved(), "device_used": total - free}
    import psutil

    return {"rss": psutil.Process().memory_info().rss}


def _freed(awake: dict[str, int], asleep: dict[str, int], before_load: dict[str, int]) -> dict[str, float]:
    """Per reading: the share of what the engine added since before it loaded that the sleep gave back."""
    out = {}
    for key, held in awake.items():
        added = held - before_load.get(key, 0)
        out[key] = (held - asleep[key]) / added if added > 0 else float("nan")
    return out


def build_counts(engine) -> dict[str, float]:
    """Process-wide and engine counts of work a request may do once and then never again:
    dynamo's compiled graphs and compile seconds (all of the process's compiled functions), and
    the decoder engine's captures and tunings (where it captures graphs)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    out = {"dynamo_graphs": counters["stats"]["unique_graphs"],
           "dynamo_compile_s": sum(sum(times) for times in compilation_time_metrics.values())}
    graphs = engine.engines.graphs if engine.engines is not None else None
    if graphs is not None:
        out.update(graphs.capture_state())
    return out


def _changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0) for key in after}


def _timed_question(engine, picture) -> dict[str, Any]:
    """One question: seconds from it to its first token, the result's timings and cache, and what
    was compiled, captured or tuned while it ran (counts' changes; ``*_graphs`` are held graphs)."""
    from edgeinfer.engine import SamplingParams

    built = build_counts(engine)
    started = time.perf_counter()
    result = engine.generate(QUESTION, [picture], SamplingParams(max_new_tokens=1, ignore_eos=True))
    to_first_token_s = time.perf_counter() - started
    return {"to_first_token_s": to_first_token_s, "timings": result.timings, "cache": result.cache,
            "built": _changes(built, build_counts(engine))}


def bench(spec: SleepBenchSpec) -> dict[str, Any]:
    from edgeinfer.engine import Engine
    from edgeinfer.profiles import load_profile

    profile = load_profile(spec.profile, spec.overrides)
    device = profile.runtime.device
    before_load = memory_held(device)
    engine = Engine.load(spec.model, profile=profile, backend="torch")
    picture = bench_image(spec.image_size)
    first = _timed_question(engine, picture)  # warm-up: compilation, graphs, caches
    again = _timed_question(engine, picture)  # the prefix reused: the path every question after a wake takes
    log = RunLog()  # each run with the load average before and after it
    for repeat in range(spec.repeats):
        for level in spec.levels:
            with log.run(f"level {level} #{repeat}") as record:
                awake = memory_held(device)
                report = engine.sleep(level)
                asleep = memory_held(device)
                question = _timed_question(engine, picture)
                record.update({"repeat": repeat, "level": level, "awake": awake, "asleep": asleep,
                               "freed_fraction": _freed(awake, asleep, before_load), "sleep_s": report.seconds,
                               "weights": report.weights, "freed_kv_bytes": report.freed_kv_bytes,
                               "wake_s": float(question["timings"]["wake_s"] or 0.0),
                               "wake_to_first_token_s": question["to_first_token_s"], "question": question})
    engine.close()
    runs = log.records
    summary = {str(level): _summary([r for r in runs if r["level"] == level]) for level in spec.levels}
    return {**raw.header("sleep", spec.to_json(), environment(device)), "before_load": before_load,
            "awake_first_token_s": first["to_first_token_s"], "awake_question": first, "awake_again": again,
            "runs": runs, "summary": summary}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = runs[0]["freed_fraction"].keys()
    return {"freed_fraction_median": {k: statistics.median(r["freed_fraction"][k] for r in runs) for k in keys},
            "wake_s_median": statistics.median(r["wake_s"] for r in runs),
            "wake_to_first_token_s_median": statistics.median(r["wake_to_first_token_s"] for r in runs),
            "wake_to_first_token_s_max": max(r["wake_to_first_token_s"] for r in runs)}


# The breakdown's columns: (heading, where in a question, format).
BREAKDOWN = (
    ("to first token s", ("to_first_token_s",), "{:.3f}"),
    ("wake s", ("timings", "wake_s"), "{:.3f}"),
    ("of which captures s", ("timings", "wake_capture_s"), "{:.3f}"),
    ("vision s", ("timings", "vision_s"), "{:.3f}"),
    ("prefill s", ("timings", "prefill_s"), "{:.3f}"),
    ("prefix reused", ("cache", "prefix_tokens_reused"), "{}"),
    ("blocks restored", ("cache", "restored_blocks"), "{}"),
    ("dynamo graphs", ("built", "dynamo_graphs"), "{:g}"),
    ("dynamo compile s", ("built", "dynamo_compile_s"), "{:.2f}"),
    ("captures", ("built", "captures"), "{:g}"),
    ("fused tiles tuned", ("built", "fused_tuned"), "{:g}"),
)


def _cell(question: dict[str, Any], path: tuple[str, ...], fmt: str) -> str:
    value: Any = question
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return "-" if value is None else fmt.format(value)


def _breakdown(report: dict[str, Any]) -> list[str]:
    """One row per question: where its time to the first token went and what it built."""
    lines = ["| question | " + " | ".join(h for h, _, _ in BREAKDOWN) + " |", "|---" * (len(BREAKDOWN) + 1) + "|"]
    rows = [("after load", report["awake_question"]), ("after load, again", report["awake_again"])]
    rows += [(f"level {r['level']} #{r['repeat']}", r["question"]) for r in report["runs"]]
    for name, question in rows:
        lines.append(f"| {name} | " + " | ".join(_cell(question, path, fmt) for _, path, fmt in BREAKDOWN) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = ["| level | freed (median) | wake s | wake to first token s |", "|---|---|---|---|"]
    for level, s in report["summary"].items():
        freed = ", ".join(f"{k} {v:.1%}" for k, v in s["freed_fraction_median"].items())
        lines.append(f"| {level} | {freed} | {s['wake_s_median']:.3f} | {s['wake_to_first_token_s_median']:.3f} |")
    lines += ["", "Where each question's time went (its wake included) and what it compiled, captured or tuned:",
              "", *_breakdown(report)]
    return "\n".join(lines) + "\n"
