"""``edgeinfer bench kv``: the KV spill manager against recomputing, and against transformers' offloading cache.

One run, medians over ``--repeats``, ratios against peers measured in the same run:

- ``resume``: an idle session (one image + about 1K tokens of history) asked a follow-up
  question, its blocks on the host tier, on disk (page cache dropped), and after a
  restart; against recomputing the session (vision output cached, and not).
- ``overhead``: decode tokens/s with the spill machinery on (tiers, prefix cache, write
  through) but no pressure, against the same engine with it off.
- ``round_robin``: eight sessions take turns; the device pool holds 25% of their working
  set. Throughput against an unconstrained pool, requests that failed, tokens equal.
  On CUDA also the share of transfer time hidden behind compute.
- ``peer``: the same round robin through transformers' ``generate`` with
  ``DynamicCache(offloading=True)`` (CUDA only: that cache needs it).
- ``drift``: the int8 and fp8 host tiers under constant spilling: the largest logit
  difference against full precision and how many greedy tokens stay equal.
- ``demo``: the demo model's accuracy with the device pool squeezed, per host precision
  (when the demo model is present).

Run ``python scripts/bench_kv.py --out bench-results/`` (or ``edgeinfer bench kv``);
``report.json`` and ``report.md`` land in ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from edgeinfer.bench.common import bench_image, sync
PARTS = ("resume", "overhead", "round_robin", "peer", "drift", "demo")


@dataclass(frozen=True)
class KVBenchSpec:
    model: Path
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 2
    repeats: int = 3
    image_size: int = 512
    history_tokens: int = 1024  # the resumed session: image + history, in tokens
    session_tokens: int = 384  # each round-robin session's opening turn, in tokens
    sessions: int = 8
    rounds: int = 3
    new_tokens: int = 16
    overhead_tokens: int = 48
    pool_fraction: float = 0.25
    block_size: int = 16
    max_batch_size: int = 4
    parts: tuple[str, ...] = PARTS
    demo_questions: int = 140
    scratch: Path | None = None  # disk tier folder; a temporary one by default


# --- observing the engine ------------------------------------------------------------------------
def record_logits(engine, sink: dict) -> None:
    """Record every row of logits the engine samples from, as ``sink[(seq_id, step)]`` (float32, CPU)."""
    choose = engine._choose_tokens

    def recording(seqs, logits):
        for seq, row in zip(seqs, logits):
            sink[(seq.seq_id, len(seq.generated))] = row.detach().float().cpu().clone()
        return choose(seqs, logits)

    engine._choose_tokens = recording


@dataclass(frozen=True)
class Drift:
    max_abs: float
    compared: int  # logit rows compared (each sequence up to its first differing token)
    same_tokens: int
    total_tokens: int


def max_logit_drift(ref_logits: dict, logits: dict, ref_tokens: list[list[int]], tokens: list[list[int]]) -> Drift:
    """Largest |logit difference| between two runs of the same requests, in submission order."""
    import torch

    def by_order(rows: dict) -> dict:
        order = {sid: i for i, sid in enumerate(sorted({sid for sid, _ in rows}))}
        return {(order[sid], step): row for (sid, step), row in rows.items()}

    ref, got = by_order(ref_logits), by_order(logits)
    worst, compared = 0.0, 0
    for i, (want, have) in enumerate(zip(ref_tokens, tokens)):
        for step in range(min(len(want), len(have))):
            a, b = ref.get((i, step)), got.get((i, step))
            if a is None or b is None:
                break
            finite = torch.isfinite(a) & torch.isfinite(b)
            worst = max(worst, float((a - b)[finite].abs().max()))
            compared += 1
            if want[step] != have[step]:
                break
    same = sum(x == y for want, have in zip(ref_tokens, tokens) for x, y in zip(want, have))
    return Drift(worst, compared, same, sum(len(t) for t in ref_tokens))


# --- workloads ----------------------------------------------------------------------------------
def _words(tokenizer) -> list[str]:
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and 2 < len(w) < 9)
    return words or ["the", "cat", "sat", "on", "a", "mat"]


def _text(words: list[str], n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(n))


def prompt_len(engine, messages, images) -> int:
    seq = engine.submit(messages, images)
    engine.cancel(seq)
    engine.result(seq)
    return seq.prompt_len


def fit_text(engine, messages_of: Callable[[str], list], images: list, tokens: int, seed: int) -> list:
    """Messages whose prompt is about ``tokens`` long: filler text grown until it is."""
    words = _words(engine.adapter.tokenizer)
    n = max(8, tokens // 2)
    for _ in range(8):
        messages = messages_of(_text(words, n, seed))
        length = prompt_len(engine, messages, images)
        if abs(length - tokens) <= max(8, tokens // 50):
            break
        n = max(8, round(n * tokens / max(length, 1)))
    return messages


def opening(text: str, label: str) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": label}, {"type": "image"},
                                         {"type": "text", "text": text}]}]


def follow_up(messages: list, answer: str, question: str) -> list:
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def _sampling(tokens: int):
    from edgeinfer.engine import SamplingParams

    return SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens)


class Harness:
    """Engines over one loaded model, each with its own KV configuration."""

    def __init__(self, spec: KVBenchSpec) -> None:
        import torch

        from edgeinfer.engine import Engine, EngineConfig
        from edgeinfer.models.loader import load_model

        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.base = EngineConfig(dtype=spec.dtype, device=spec.device, threads=spec.threads,
                                 block_size=spec.block_size, max_batch_size=spec.max_batch_size,
                                 prefill_chunk=1024, max_context=8192, vision_cache_entries=64)
        self.model = load_model(spec.model, self.base.torch_dtype, spec.device)
        self._Engine = Engine
        self._scratch = tempfile.TemporaryDirectory(prefix="edgeinfer-bench-kv-") if spec.scratch is None else None
        self.scratch = Path(spec.scratch or self._scratch.name)
        self._dirs = 0

    def engine(self, *, num_blocks: int, tiers: bool, prefix_cache: bool = True, precision: str = "full",
               disk_dir: Path | None = None, **extra):
        if disk_dir is None and tiers:
            self._dirs += 1
            disk_dir = self.scratch / f"kv{self._dirs}"
        config = replace(self.base, num_blocks=num_blocks, prefix_cache=prefix_cache, host_precision=precision,
                         host_tier_mb=2048 if tiers else 0, disk_tier_mb=8192 if tiers and disk_dir else 0,
                         disk_dir=str(disk_dir) if disk_dir else None, **extra)
        from edgeinfer.backends.registry import torch_engines

        return self._Engine(self.model, config, torch_engines(self.model, config))

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()


def _ttft(engine, messages, images, tokens: int) -> tuple[float, Any]:
    result = engine.generate(messages, images, _sampling(tokens))
    return result.timings["ttft_s"], result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- parts --------------------------------------------------------------------------------------
def bench_resume(h: Harness) -> dict:
    spec = h.spec
    image = bench_image(spec.image_size, seed=1)
    blocks = 4 * (spec.history_tokens + 256) // spec.block_size
    ours = h.engine(num_blocks=blocks, tiers=True)
    recompute = h.engine(num_blocks=blocks, tiers=False, prefix_cache=False)
    for engine in (ours, recompute):  # allocator and kernel warm-up
        engine.generate("hello there", [bench_image(64, seed=9)], _sampling(2))
    base = fit_text(ours, lambda t: opening(t, "session"), [image], spec.history_tokens, seed=1)
    first = ours.generate(base, [image], _sampling(spec.new_tokens))  # the session, now idle
    recompute.generate(base, [image], _sampling(1))  # its vision output is cached there too
    words = _words(ours.adapter.tokenizer)
    rows: dict[str, list[float]] = {"recompute": [], "host": [], "disk": []}
    checks = []
    for r in range(spec.repeats):
        question = f"{_text(words, 6, 100 + r)} ?"
        messages = follow_up(base, first.text, question)
        rows["recompute"].append(_ttft(recompute, messages, [image], 1)[0])
        ours.kv_manager.spill_idle("host")
        t, res = _ttft(ours, messages, [image], 1)
        rows["host"].append(t)
        checks.append(res.cache)
        ours.kv_manager.spill_idle("disk")
        ours.kv_manager.disk.drop_page_cache()
        t, res = _ttft(ours, messages, [image], 1)
        rows["disk"].append(t)
        checks.append(res.cache)
    recompute._vision_cache.clear()
    messages = follow_up(base, first.text, "one more question ?")
    full_recompute, probe = _ttft(recompute, messages, [image], 1)
    disk_dir = Path(ours.config.disk_dir)
    metrics = ours.kv_metrics()
    ours.close()
    restarted = h.engine(num_blocks=blocks, tiers=True, disk_dir=disk_dir)
    restarted.generate("hello there", [bench_image(64, seed=9)], _sampling(2))
    restarted.kv_manager.disk.drop_page_cache()
    restart_s, restart = _ttft(restarted, follow_up(base, first.text, f"{_text(words, 6, 100)} ?"), [image], 1)
    restarted.close()
    med = {k: _median(v) for k, v in rows.items()}
    return {
        "session_tokens": probe.usage["prompt_tokens"], "image_tokens": probe.usage["image_tokens"],
        "ttft_s": {**med, "recompute_with_vision": full_recompute, "disk_after_restart": restart_s},
        "ratios": {"host_vs_recompute": med["recompute"] / med["host"],
                   "disk_vs_recompute": med["recompute"] / med["disk"],
                   "host_vs_recompute_with_vision": full_recompute / med["host"],
                   "restart_vs_recompute_with_vision": full_recompute / restart_s},
        "reused": {"host_and_disk": checks, "restart": restart.cache},
        "restore": {"bytes": metrics.restore_bytes, "latency_mean_s": metrics.restore_latency.mean},
        "runs": rows,
    }


def _timed(obj, name: str, sink: list[float]) -> None:
    """Record the wall time of every call of ``obj.name``."""
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - started)
        return out

    setattr(obj, name, timed)


def bench_overhead(h: Harness) -> dict:
    """Decode without pressure, machinery on against off: tokens/s (noisy on a shared CPU), and the
    time the scheduler and KV manager take per step against the step (robust to noise)."""
    spec = h.spec
    engines = {"on": h.engine(num_blocks=512, tiers=True), "off": h.engine(num_blocks=512, tiers=False,
                                                                            prefix_cache=False)}
    prompt = "describe a quiet morning by the sea in many words"
    rates: dict[str, list[float]] = {"on": [], "off": []}
    schedule: dict[str, list[float]] = {"on": [], "off": []}
    steps: dict[str, list[float]] = {"on": [], "off": []}
    for name, engine in engines.items():
        engine.generate(prompt, [], _sampling(4))
        _timed(engine.scheduler, "schedule", schedule[name])
        _timed(engine, "step", steps[name])
    for r in range(2 * spec.repeats):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            result = engines[name].generate(prompt, [], _sampling(spec.overhead_tokens))
            engines[name].kv_manager.worker.drain()  # background writes must not land in the other's run
            rates[name].append(result.timings["decode_tokens_per_s"])
    engines["on"].close()
    med = {k: _median(v) for k, v in rates.items()}
    sched = {k: _median(v) for k, v in schedule.items()}
    step = {k: _median(v) for k, v in steps.items()}
    return {"decode_tok_s": med, "overhead": 1 - med["on"] / med["off"],
            "schedule_us": {k: v * 1e6 for k, v in sched.items()}, "step_ms": {k: v * 1e3 for k, v in step.items()},
            "machinery_share_of_step": (sched["on"] - sched["off"]) / step["on"], "runs": rates}


def _sessions(h: Harness, engine, image) -> list[list]:
    """One opening turn per session. Each starts with its own words before the shared image, so no
    two sessions share a block (digits alone may all be one unknown token to a tokenizer)."""
    words = _words(engine.adapter.tokenizer)
    return [fit_text(engine, lambda t, i=i: opening(t, _text(words, 4, 7000 + i)), [image], h.spec.session_tokens,
                     seed=i) for i in range(h.spec.sessions)]


def _questions(engine, rounds: int, sessions: int) -> list[list[str]]:
    words = _words(engine.adapter.tokenizer)
    return [[f"{_text(words, 5, 1000 * r + i)} ?" for i in range(sessions)] for r in range(rounds)]


def run_round_robin(engine, sessions: list[list], questions: list[list[str]], image, new_tokens: int,
                    logits: dict | None = None) -> dict:
    """Every round submits one turn per session; the engine batches and schedules them."""
    if logits is not None:
        record_logits(engine, logits)
    conversations = [list(s) for s in sessions]
    tokens: list[list[int]] = []
    failed = generated = 0
    started = time.perf_counter()
    for r, round_questions in enumerate(questions):
        turns = [c if r == 0 else c + [{"role": "user", "content": q}] for c, q in zip(conversations, round_questions)]
        try:
            seqs = [engine.submit(t, [image], _sampling(new_tokens)) for t in turns]
            results = engine.run_until_done(seqs)
        except Exception as error:  # noqa: BLE001 - a failed request is what this counts
            failed += len(turns)
            print(f"round {r} failed: {error!r}")
            continue
        for i, result in enumerate(results):
            tokens.append(result.token_ids)
            generated += len(result.token_ids)
            failed += result.finish_reason not in ("length", "stop")
            conversations[i] = turns[i] + [{"role": "assistant", "content": result.text}]
    sync(str(engine.config.device))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens_per_s": generated / wall, "generated": generated, "failed": failed,
            "tokens": tokens, "counters": engine.counters, "metrics": engine.kv_metrics()}


def _final_blocks(engine, sessions, image, rounds: int, new_tokens: int, block_size: int) -> list[int]:
    """Blocks of each session's last turn (its opening, and each round's question and answer)."""
    return [-(-(prompt_len(engine, s, [image]) + rounds * (new_tokens + 24)) // block_size) for s in sessions]


def bench_round_robin(h: Harness) -> dict:
    """Unconstrained and squeezed runs alternate over the repeats (fresh engines, the same model), so
    a shared machine's load changes hit both; medians of tokens/s."""
    spec = h.spec
    image = bench_image(spec.image_size, seed=2)
    probe = h.engine(num_blocks=64, tiers=False)
    sessions = _sessions(h, probe, image)
    questions = _questions(probe, spec.rounds, spec.sessions)
    final = _final_blocks(probe, sessions, image, spec.rounds, spec.new_tokens, spec.block_size)
    working, longest = sum(final), max(final)
    pool = max(int(spec.pool_fraction * working), longest + 2)
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for r in range(spec.repeats):
        order = ("unconstrained", "constrained") if r % 2 == 0 else ("constrained", "unconstrained")
        for name in order:
            engine = h.engine(num_blocks=2 * working if name == "unconstrained" else pool, tiers=True)
            engine.generate("hello there", [image], _sampling(2))  # vision of the shared image, warm-up
            runs[name].append(run_round_robin(engine, sessions, questions, image, spec.new_tokens))
            engine.close()
    rate = {name: _median([run["tokens_per_s"] for run in done]) for name, done in runs.items()}
    last = {name: done[-1] for name, done in runs.items()}
    return {
        "working_set_blocks": working, "pool_blocks": pool, "pool_fraction": pool / working,
        "tokens_per_s": rate, "throughput_ratio": rate["constrained"] / rate["unconstrained"],
        "failed": sum(run["failed"] for done in runs.values() for run in done),
        "same_tokens": all(run["tokens"] == runs["unconstrained"][0]["tokens"] for done in runs.values()
                           for run in done),
        "constrained": _kv_summary(last["constrained"]["metrics"], last["constrained"]["counters"]),
        "unconstrained": _kv_summary(last["unconstrained"]["metrics"], last["unconstrained"]["counters"]),
        "runs": {name: [run["tokens_per_s"] for run in done] for name, done in runs.items()},
        "_sessions": sessions, "_questions": questions,
    }


def _kv_summary(m, counters: dict) -> dict:
    return {"preemptions": m.preemptions, "spilled_blocks": m.spilled_blocks, "restored_blocks": m.restored_blocks,
            "persisted_blocks": m.persisted_blocks, "spill_bytes": m.spill_bytes, "restore_bytes": m.restore_bytes,
            "spill_latency_mean_s": m.spill_latency.mean, "restore_latency_mean_s": m.restore_latency.mean,
            "transfer_s": m.transfer_s, "wait_s": m.wait_s, "hidden_ratio": m.hidden_ratio,
            "prefix_hit_ratio": m.prefix_hit_ratio, "recomputes": m.recomputes, "lost_blocks": m.lost_blocks,
            "prefill_tokens": counters.get("prefill_tokens"), "decode_steps": counters.get("decode_steps")}


def bench_peer(h: Harness, sessions: list[list], questions: list[list[str]]) -> dict:
    """transformers' generate with DynamicCache(offloading=True) over the same turns (it keeps no
    cache between requests, so each turn sends the whole conversation again)."""
    import torch

    spec = h.spec
    if not spec.device.startswith("cuda"):
        return {"skipped": "DynamicCache(offloading=True) needs CUDA"}
    from transformers import AutoModelForImageTextToText, DynamicCache

    dtype = getattr(torch, spec.dtype)
    model = AutoModelForImageTextToText.from_pretrained(spec.model, dtype=dtype).to(spec.device).eval()
    prompts = h.engine(num_blocks=64, tiers=False)
    image = bench_image(spec.image_size, seed=2)
    pixels = prompts.adapter.image_processor(images=[[image]], return_tensors="pt")
    extra = {k: v.to(spec.device) for k, v in pixels.items() if k != "pixel_values"}
    conversations = [list(s) for s in sessions]
    generated = 0
    started = time.perf_counter()
    for r, round_questions in enumerate(questions):
        for i, q in enumerate(round_questions):
            turn = conversations[i] if r == 0 else conversations[i] + [{"role": "user", "content": q}]
            seq = prompts.submit(turn, [image])
            prompts.cancel(seq)
            prompts.result(seq)
            ids = torch.tensor([seq.prompt_ids], device=spec.device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     pixel_values=pixels["pixel_values"].to(spec.device, dtype), **extra,
                                     past_key_values=DynamicCache(config=model.config, offloading=True),
                                     max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False)
            new = out[0, ids.shape[1]:].tolist()
            generated += len(new)
            text = prompts.adapter.tokenizer.decode(new, skip_special_tokens=True).strip()
            conversations[i] = turn + [{"role": "assistant", "content": text}]
    sync(spec.device)
    wall = time.perf_counter() - started
    del model
    gc.collect()
    return {"tokens_per_s": generated / wall, "wall_s": wall, "generated": generated}


def bench_drift(h: Harness) -> dict:
    from edgeinfer.kv.codec import fp8_supported

    spec = h.spec
    image = bench_image(spec.image_size, seed=3)
    probe = h.engine(num_blocks=64, tiers=False)
    words = _words(probe.adapter.tokenizer)
    sessions = [fit_text(probe, lambda t, i=i: opening(t, _text(words, 4, 8000 + i)), [image], 96, seed=50 + i)
                for i in range(4)]
    questions = _questions(probe, 2, len(sessions))
    longest = max(_final_blocks(probe, sessions, image, 2, spec.new_tokens, spec.block_size))
    ref_logits: dict = {}
    reference = run_round_robin(h.engine(num_blocks=8 * longest, tiers=False), sessions, questions, image,
                                spec.new_tokens, ref_logits)
    out = {}
    for precision in ("full", "int8", "fp8"):
        if precision == "fp8" and not fp8_supported(spec.device):
            out[precision] = {"skipped": "no float8_e4m3fn in this torch"}
            continue
        logits: dict = {}
        engine = h.engine(num_blocks=longest + 2, tiers=True, precision=precision, high_watermark=0.4,
                          low_watermark=0.2)
        run = run_round_robin(engine, sessions, questions, image, spec.new_tokens, logits)
        engine.close()
        drift = max_logit_drift(ref_logits, logits, reference["tokens"], run["tokens"])
        out[precision] = {**asdict(drift), "restored_blocks": run["metrics"].restored_blocks,
                          "preemptions": run["metrics"].preemptions}
    return out


def bench_demo(h: Harness) -> dict:
    """The demo model's accuracy when its prompts come back from a squeezed pool's host tier.

    Each group of eight questions is asked twice: the first round fills the prefix cache,
    and the pool (blocks for about two of the eight prompts) pushes those blocks to the
    host tier; the second round finds them there and restores them, in the tier's
    precision, instead of running the prompt again. Accuracy is the second round's.
    """
    from edgeinfer.demo import DEMO_MODEL_DIR, synthetic
    from edgeinfer.engine import Engine, EngineConfig, SamplingParams

    if not (DEMO_MODEL_DIR / "config.json").is_file():
        return {"skipped": f"no demo model in {DEMO_MODEL_DIR}"}
    samples = synthetic.held_out(1234, h.spec.demo_questions)
    out = {}
    for precision in ("none", "full", "int8", "fp8"):
        squeeze = precision != "none"
        config = EngineConfig(num_blocks=48 if squeeze else 4096, block_size=4, max_batch_size=8,
                              host_tier_mb=64 if squeeze else 0, host_precision="full" if not squeeze else precision,
                              high_watermark=0.4, low_watermark=0.2, threads=h.spec.threads)
        engine = Engine.load(DEMO_MODEL_DIR, config=config)
        correct = reused = 0
        for start in range(0, len(samples), 8):
            batch = samples[start:start + 8]
            for _ in range(2):
                seqs = [engine.submit(s.question, [s.image], SamplingParams(max_new_tokens=8)) for s in batch]
                results = engine.run_until_done(seqs)
            correct += sum(r.text.strip().strip(".!? ").lower() == s.answer for s, r in zip(batch, results))
            reused += sum(r.cache["prefix_tokens_reused"] for r in results)
        out[precision] = {"accuracy": correct / len(samples), "n": len(samples),
                          "restored_blocks": engine.counters["restored_blocks"],
                          "prefix_tokens_reused": reused, "preemptions": engine.counters["preemptions"]}
        engine.close()
    return out


# --- the run ---------------------------------------------------------------------------------------
def environment(spec: KVBenchSpec) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "threads": spec.threads, "device": spec.device, "dtype": spec.dtype, "machine": platform.machine()}
    try:
        env["load_average"] = os.getloadavg()
    except OSError:
        pass
    if spec.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _run_part(h: Harness, part: str, report: dict) -> dict:
    spec = h.spec
    if part == "resume":
        return bench_resume(h)
    if part == "overhead":
        return bench_overhead(h)
    if part == "round_robin":
        return bench_round_robin(h)
    if part == "peer":
        rr = report.get("round_robin") or {}
        if "_sessions" not in rr:
            probe = h.engine(num_blocks=64, tiers=False)
            image = bench_image(spec.image_size, seed=2)
            rr = {**rr, "_sessions": _sessions(h, probe, image),
                  "_questions": _questions(probe, spec.rounds, spec.sessions)}
        out = bench_peer(h, rr["_sessions"], rr["_questions"])
        if "tokens_per_s" in out and "tokens_per_s" in rr:
            out["ours_vs_peer"] = rr["tokens_per_s"]["constrained"] / out["tokens_per_s"]
        return out
    if part == "drift":
        return bench_drift(h)
    if part == "demo":
        return bench_demo(h)
    raise ValueError(f"unknown part {part!r}; choose from {', '.join(PARTS)}")


def _public(report: dict) -> dict:
    return {name: {k: v for k, v in part.items() if not k.startswith("_")} if isinstance(part, dict) else part
            for name, part in report.items()}


def run(spec: KVBenchSpec, log: Callable[[str], None] = print,
        checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Every part in turn; a part that fails is recorded as its error and the run goes on.
    ``checkpoint(report)`` is called after each part (the report so far)."""
    import traceback

    h = Harness(spec)
    report: dict[str, Any] = {"spec": {k: str(v) for k, v in asdict(spec).items()}, "environment": environment(spec)}
    try:
        for part in spec.parts:
            started = time.perf_counter()
            log(f"[bench kv] {part} ...")
            try:
                report[part] = _run_part(h, part, report)
            except Exception as error:  # noqa: BLE001 - one broken part must not lose the others
                report[part] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                log(report[part]["traceback"])
            report[part]["seconds"] = time.perf_counter() - started
            gc.collect()
            if checkpoint is not None:
                checkpoint(_public(report))
    finally:
        h.close()
    return _public(report)


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# edgeinfer bench kv — {env.get('gpu', 'CPU')} ({env['device']}, {env['dtype']}, "
             f"{env['threads']} threads, torch {env['torch']})", ""]
    failed = {name: part["error"] for name, part in report.items() if isinstance(part, dict) and "error" in part}
    lines += [f"**{name} failed**: {error}" for name, error in failed.items()] + ([""] if failed else [])
    report = {name: part for name, part in report.items() if name not in failed}
    if "resume" in report:
        r = report["resume"]
        t, q = r["ttft_s"], r["ratios"]
        lines += ["## Resume an idle session", "",
                  f"Session: {r['session_tokens']} tokens ({r['image_tokens']} image tokens); time to first token "
                  "of a follow-up question, median.", "",
                  "| from | TTFT s | vs recompute (vision cached) | vs recompute with vision |", "|---|---|---|---|",
                  f"| host tier | {_fmt(t['host'])} | {_fmt(q['host_vs_recompute'])}x | "
                  f"{_fmt(q['host_vs_recompute_with_vision'])}x |",
                  f"| disk tier (page cache dropped) | {_fmt(t['disk'])} | {_fmt(q['disk_vs_recompute'])}x | |",
                  f"| disk after a restart | {_fmt(t['disk_after_restart'])} | | "
                  f"{_fmt(q['restart_vs_recompute_with_vision'])}x |",
                  f"| recompute (vision cached) | {_fmt(t['recompute'])} | 1x | |",
                  f"| recompute with vision | {_fmt(t['recompute_with_vision'])} | | 1x |", ""]
    if "overhead" in report:
        o = report["overhead"]
        lines += ["## Decode without pressure", "",
                  f"Decode tokens/s with the spill machinery on {_fmt(o['decode_tok_s']['on'])}, off "
                  f"{_fmt(o['decode_tok_s']['off'])}: {o['overhead']:.1%} slower (median of interleaved runs). "
                  f"Scheduler and KV manager per step: {_fmt(o['schedule_us']['on'])} us on, "
                  f"{_fmt(o['schedule_us']['off'])} us off, of a {_fmt(o['step_ms']['on'])} ms step: the machinery "
                  f"costs {o['machinery_share_of_step']:.2%} of a decode step.", ""]
    if "round_robin" in report:
        r = report["round_robin"]
        c = r["constrained"]
        lines += ["## Eight sessions, round robin", "",
                  f"Device pool {r['pool_blocks']} blocks = {r['pool_fraction']:.0%} of the working set "
                  f"({r['working_set_blocks']} blocks).", "",
                  "| pool | tokens/s |", "|---|---|",
                  f"| unconstrained | {_fmt(r['tokens_per_s']['unconstrained'])} |",
                  f"| 25% of the working set | {_fmt(r['tokens_per_s']['constrained'])} |", "",
                  f"Throughput ratio {r['throughput_ratio']:.1%}; failed requests {r['failed']}; greedy tokens equal: "
                  f"{r['same_tokens']}. Constrained run: {c['preemptions']} preemptions, {c['spilled_blocks']} blocks "
                  f"spilled, {c['restored_blocks']} restored, prefix hit ratio {c['prefix_hit_ratio']:.1%}, "
                  f"transfer time {_fmt(c['transfer_s'])} s of which the engine waited {_fmt(c['wait_s'])} s "
                  f"(hidden: {_fmt(c['hidden_ratio'])}).", ""]
    if "peer" in report:
        p = report["peer"]
        if "skipped" in p:
            lines += ["## Peer: transformers DynamicCache(offloading=True)", "", f"Skipped: {p['skipped']}.", ""]
        else:
            lines += ["## Peer: transformers DynamicCache(offloading=True)", "",
                      f"Same turns through generate(): {_fmt(p['tokens_per_s'])} tokens/s; ours (25% pool) / peer: "
                      f"{_fmt(p.get('ours_vs_peer'))}x.", ""]
    if "drift" in report:
        lines += ["## Compressed host tier", "", "| precision | max logit drift | rows compared | tokens equal |",
                  "|---|---|---|---|"]
        for name, d in report["drift"].items():
            if isinstance(d, dict) and "max_abs" in d:
                lines.append(f"| {name} | {_fmt(d['max_abs'])} | {d['compared']} | "
                             f"{d['same_tokens']}/{d['total_tokens']} |")
        lines.append("")
    if "demo" in report:
        d = report["demo"]
        lines += ["## Demo model accuracy, squeezed pool", ""]
        if "skipped" in d:
            lines += [f"Skipped: {d['skipped']}.", ""]
        else:
            lines += ["Each question asked twice; accuracy of the second round, whose prompts come back "
                      "from the host tier (`none`: an unconstrained pool, the prompts reused on the device).", "",
                      "| host tier | accuracy | blocks restored | prompt tokens reused |", "|---|---|---|---|"]
            lines += [f"| {k} | {v['accuracy']:.1%} | {v['restored_blocks']} | {v['prefix_tokens_reused']} |"
                      for k, v in d.items() if isinstance(v, dict)]
            lines.append("")
    return "\n".join(lines)


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="edgeinfer bench kv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: a random "
                        "SmolVLM-256M-shaped one, built once under --cache)")
    parser.add_argument("--size", default="smolvlm-256m", help="shape of the built checkpoint")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgeinfer" / "bench")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--history-tokens", type=int, default=1024)
    parser.add_argument("--session-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    import torch

    from edgeinfer.testing.checkpoints import make_checkpoint

    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model
    if model is None:
        model = args.cache / f"smolvlm-{args.size}"
        if not (model / "model.safetensors").is_file():
            make_checkpoint("smolvlm", model, size=args.size)
    spec = KVBenchSpec(model=model, device=device, dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
                       threads=args.threads, repeats=args.repeats, parts=tuple(p for p in args.parts.split(",") if p),
                       history_tokens=args.history_tokens, session_tokens=args.session_tokens, rounds=args.rounds,
                       new_tokens=args.new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)

    def save(report: dict) -> str:
        (args.out / "kv.json").write_text(json.dumps(report, indent=2, default=_json_default))
        text = markdown(report)
        (args.out / "kv.md").write_text(text)
        return text

    report = run(spec, checkpoint=save)
    print(save(report))
    return report


if __name__ == "__main__":
    main()
