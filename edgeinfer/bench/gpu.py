"""GPU benchmark: ours against transformers' generate() at batch 1, 4 and 16, over the same spans.

One run; every engine in its own worker process (the peer's holds nothing of ours):

- ours: the torch backend, CUDA graphs, the tower readied for the picture's size;
- ``transformers-static``: ``generate()`` with ``cache_implementation="static"``, which
  compiles its decode step with ``torch.compile`` (mode ``reduce-overhead``);
- ``transformers-dynamic``: ``generate()`` with its default dynamic cache, eager.

Every engine answers the same requests: ``b`` different pictures of the same size (so each
request pays for its own vision encoder, and no engine reuses another request's), the same
question, exactly ``new_tokens`` tokens (EOS ignored). Ours has no prefix cache and its
vision cache is cleared before every call. Each repeat times two whole calls with the
device synchronised: ``T_n`` (``new_tokens`` tokens) and ``T_1`` (one token: preprocessing,
vision, prefill and the first token). Both sides get the same two figures:

- whole request: ``b * new_tokens / T_n``;
- decode only: ``b * (new_tokens - 1) / (T_n - T_1)``;
- time to first token (batch 1): ``T_1``.

A ratio is ours over the *fastest* peer configuration at that batch size and span. The
roofline uses the best of three bandwidth probes (copy, sum, GEMV), each in the raw file.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from edgeinfer.bench import raw
from edgeinfer.bench.common import bench_image, environment, peak_memory_mb, sync
from edgeinfer.bench.quiet import QUIET_LOAD, LoadTracker, RunLog, judge, refuse_if_noisy
from edgeinfer.bench.roofline import Probe, best_bandwidth_gbs, roofline
from edgeinfer.bench.stats import Spread, ratio, spread

QUESTION = "Describe this image."
OURS = "ours"
PEERS = ("transformers-static", "transformers-dynamic")
KINDS = (OURS, *PEERS)


@dataclass(frozen=True)
class GpuBenchSpec:
    model: Path
    image_size: tuple[int, int] = (1024, 768)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    new_tokens: int = 64
    repeats: int = 3
    # Untimed calls per batch size. One suffices: its decode steps call the compiled step
    # dozens of times, so compilation and CUDA graph recording are over when timing starts.
    warmup: int = 1
    bandwidth_mib: int = 1024  # buffer size of each bandwidth probe
    dtype: str = "bfloat16"
    device: str = "cuda"
    kinds: tuple[str, ...] = KINDS

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
        if self.new_tokens < 2:
            raise ValueError("new_tokens must be >= 2: decode is timed as T(new_tokens) - T(1)")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "model": str(self.model)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GpuBenchSpec":
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in names}
        return cls(**{**data, "model": Path(data["model"]), "image_size": tuple(data["image_size"]),
                      "batch_sizes": tuple(data["batch_sizes"]), "kinds": tuple(data["kinds"])})


def prompt_digest(ids: list[int]) -> str:
    """A short digest of prompt ids, so both sides can be shown to have run the same prompt."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


# --- the measurement, the same for every engine -----------------------------------------------

Call = Callable[[int, int, list], float]  # (batch, new tokens, pictures) -> seconds of the whole call


def measure(spec: GpuBenchSpec, kind: str, call: Call, log: RunLog) -> None:
    """Warm-ups, then ``repeats`` timed pairs (``T_n``, ``T_1``) at every batch size, into ``log``."""
    for batch in spec.batch_sizes:
        images = [bench_image(spec.image_size, seed=i) for i in range(batch)]
        for i in range(spec.warmup + spec.repeats):
            timed = i >= spec.warmup
            label = f"{kind} b={batch} " + (f"#{i - spec.warmup}" if timed else f"warm-up {i}")
            with log.run(label, timed=timed) as record:
                full = call(batch, spec.new_tokens, images)
                first = call(batch, 1, images)
                record.update(batch=batch, full_s=full, first_s=first)


def run_figures(record: dict[str, Any], new_tokens: int) -> dict[str, float | None]:
    """One timed pair's figures: whole-request and decode-only tokens/s, time to first token."""
    b, full, first = record["batch"], record["full_s"], record["first_s"]
    decode = b * (new_tokens - 1) / (full - first) if full > first else None
    return {"request_tok_s": b * new_tokens / full, "decode_tok_s": decode, "first_token_s": first}


def summarize(records: list[dict[str, Any]], new_tokens: int) -> dict[int, dict[str, Spread]]:
    """Per batch size: median, min and max of every timed run's figures."""
    out: dict[int, dict[str, Spread]] = {}
    for batch in sorted({r["batch"] for r in records if r.get("timed")}):
        runs = [run_figures(r, new_tokens) for r in records if r.get("timed") and r["batch"] == batch]
        out[batch] = {key: spread(run[key] for run in runs) for key in runs[0]}
    return out


def compare(summaries: dict[str, dict[int, dict[str, Spread]]]) -> dict[int, dict[str, Any]]:
    """Per batch size and span: ours over the fastest peer configuration measured in this run."""
    peers = {k: v for k, v in summaries.items() if k != OURS}
    ours = summaries.get(OURS, {})
    out: dict[int, dict[str, Any]] = {}
    for batch, figures in ours.items():
        row: dict[str, Any] = {}
        for key, faster in (("decode_tok_s", max), ("request_tok_s", max), ("first_token_s", min)):
            candidates = {k: s[batch][key].median for k, s in peers.items() if batch in s and s[batch][key].n}
            if not candidates:
                continue
            best = faster(candidates, key=candidates.get)
            # Speed-up: a rate over a rate; for the first token, the peer's time over ours.
            value = ratio(figures[key].median, candidates[best]) if key != "first_token_s" else \
                ratio(candidates[best], figures[key].median)
            row[key] = {"fastest_peer": best, "peer": candidates[best], "ours": figures[key].median, "speedup": value}
        out[batch] = row
    return out


# --- ours ----------------------------------------------------------------------------------------

def run_ours(spec: GpuBenchSpec) -> dict[str, Any]:
    from edgeinfer.engine import Engine, EngineConfig, SamplingParams

    cuda = spec.device.startswith("cuda")
    # The picture's size is named as a profile names its cameras' (runtime.vision_compile_sizes),
    # so the tower is ready for it at load. No prefix cache: every request pays for its prefill.
    config = EngineConfig(dtype=spec.dtype, device=spec.device, max_batch_size=max(spec.batch_sizes), block_size=16,
                          kv_budget_mb=1024, max_context=4096, prefill_chunk=4096, vision_cache_entries=1,
                          cuda_graphs=cuda, prefix_cache=False, vision_compile_sizes=(spec.image_size,) if cuda else ())
    engine = Engine.load(spec.model, config=config)
    prompts: list[list[int]] = []

    def call(batch: int, new_tokens: int, images: list) -> float:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        engine.vision_cache.clear()
        sync(spec.device)
        started = time.perf_counter()
        seqs = [engine.submit(QUESTION, [image], params) for image in images]
        results = engine.run_until_done(seqs)
        sync(spec.device)
        seconds = time.perf_counter() - started
        if any(len(r.token_ids) != new_tokens for r in results):
            raise RuntimeError(f"ours generated {[len(r.token_ids) for r in results]} tokens, not {new_tokens}")
        prompts.append(seqs[0].prompt_ids)
        return seconds

    log = RunLog()
    measure(spec, OURS, call, log)
    decoder = engine.model.decoder
    return {"runs": log.records, "prompt_tokens": len(prompts[0]), "prompt_digest": prompt_digest(prompts[0]),
            "peak_memory_mb": peak_memory_mb(spec.device),
            "text_weight_bytes": sum(p.numel() * p.element_size() for n, p in decoder.named_parameters()
                                     if n != "embed"),  # a tied head is lm_head_t, read every step
            "kv_bytes_per_token": engine.kv.bytes_per_block // engine.config.block_size,
            "diagnostics": _diagnostics(engine)}


def _diagnostics(engine) -> dict[str, Any]:
    """What ran: graphs, bursts, compile or capture failures (reported, never used for control)."""
    decoder, vision = engine.decoder_engine, engine.vision_engine
    counters = engine.counters
    return {"decode_steps": counters.get("decode_steps"), "decode_bursts": counters.get("decode_bursts"),
            "decode_bursts_ahead": counters.get("decode_bursts_ahead"),
            "cuda_graph_captures": getattr(decoder, "captures", None),
            "prefill_replays": getattr(decoder, "prefill_replays", None),
            "compile_error": getattr(decoder, "compile_error", None),
            "vision_captured": bool(getattr(vision, "captured_signatures", None)),
            "vision_compiled": bool(getattr(vision, "compiled_signatures", None)),
            "vision_capture_error": getattr(vision, "capture_error", None),
            "vision_compile_error": getattr(engine, "vision_compile_error", None)}


def run_bandwidth(spec: GpuBenchSpec) -> dict[str, Any]:
    from edgeinfer.bench.roofline import measure_probes

    probes = measure_probes(spec.device, mib=spec.bandwidth_mib, dtype=spec.dtype)
    return {"probes": [p.to_dict() for p in probes], "environment": environment(spec.device)}


# --- the run ---------------------------------------------------------------------------------------

@dataclass
class GpuReport:
    spec: GpuBenchSpec
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    probes: list[Probe] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)  # read in a worker: this process stays off the GPU

    def summaries(self) -> dict[str, dict[int, dict[str, Spread]]]:
        return {kind: summarize(r["runs"], self.spec.new_tokens) for kind, r in self.results.items()}

    def same_prompt(self) -> bool:
        return len({r["prompt_digest"] for r in self.results.values()}) <= 1

    def roofline(self) -> dict[int, dict[str, float]]:
        ours = self.results.get(OURS)
        if not ours or not self.probes:
            return {}
        rates = {b: s["decode_tok_s"].median for b, s in summarize(ours["runs"], self.spec.new_tokens).items()}
        context = ours["prompt_tokens"] + self.spec.new_tokens / 2
        return roofline(rates, best_bandwidth_gbs(self.probes), ours["text_weight_bytes"], ours["kv_bytes_per_token"],
                        context)


def run(spec: GpuBenchSpec, log: Callable[[str], None] = print) -> GpuReport:
    from edgeinfer.bench.common import call_worker

    report = GpuReport(spec)
    tasks = [("gpu-bandwidth", "bandwidth")] + [(f"gpu-{kind}", kind) for kind in spec.kinds]
    for task, name in tasks:
        log(f"[bench gpu] {spec.model.name}: {name} ...")
        started = time.perf_counter()
        try:
            out = call_worker(task, spec.to_json())
        except RuntimeError as error:
            report.errors[name] = str(error)
            log(f"[bench gpu] {name} failed:\n{str(error)[-2000:]}")
            continue
        log(f"[bench gpu] {name}: {time.perf_counter() - started:.0f} s")
        if name == "bandwidth":
            report.probes = [Probe(p["name"], p["bytes"], p["seconds"]) for p in out["probes"]]
            report.environment = out["environment"]
        else:
            report.results[name] = out
    return report


def to_raw(report: GpuReport, tracker: LoadTracker, max_load: float, allow_noisy: bool) -> tuple[dict, Any]:
    records = [r for result in report.results.values() for r in result["runs"]]
    verdict = judge(records, tracker.share_at, max_load, enforced=not report.spec.device.startswith("cuda"))
    summaries = report.summaries()
    body = {"bandwidth": {"probes": [p.to_dict() for p in report.probes],
                          "best_gbs": best_bandwidth_gbs(report.probes) if report.probes else None},
            "results": {k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in report.results.items()},
            "runs": {k: v["runs"] for k, v in report.results.items()},
            "summary": summaries, "speedups": compare(summaries), "roofline": report.roofline(),
            "same_prompt": report.same_prompt(), "errors": report.errors}
    head = raw.header("gpu", report.spec.to_json(), report.environment or environment("cpu"))
    problems = raw.comparison_problems(report.errors, report.same_prompt())
    return raw.with_verdict({**head, **body}, verdict, allow_noisy, problems), verdict


def _cell(s: Spread, scale: float = 1.0, digits: int = 0) -> str:
    if not s.n:
        return "–"
    return f"{s.median * scale:.{digits}f} ({s.min * scale:.{digits}f}–{s.max * scale:.{digits}f})"


def markdown(report: GpuReport) -> str:
    spec, summaries, speedups = report.spec, report.summaries(), compare(report.summaries())
    batches = list(spec.batch_sizes)
    lines = [f"Medians of {spec.repeats} timed pairs of calls (min–max) per batch size, after {spec.warmup} "
             f"untimed; {spec.new_tokens} tokens; {spec.image_size[0]}×{spec.image_size[1]} pictures, one per "
             "request.", ""]
    for key, title, scale, digits in (("decode_tok_s", "decode only (tok/s)", 1, 0),
                                      ("request_tok_s", "whole request (tok/s)", 1, 0)):
        lines += ["| engine | " + " | ".join(f"{title} b={b}" for b in batches) + " |",
                  "|---" * (1 + len(batches)) + "|"]
        for kind, per_batch in summaries.items():
            lines.append(f"| {kind} | " + " | ".join(_cell(per_batch[b][key], scale, digits) if b in per_batch
                                                      else "–" for b in batches) + " |")
        lines.append("| **ours / fastest peer** | " + " | ".join(
            f"**{speedups[b][key]['speedup']:.2f}×** ({speedups[b][key]['fastest_peer']})"
            if b in speedups and key in speedups[b] else "–" for b in batches) + " |")
        lines.append("")
    if 1 in batches:
        lines += ["| engine | time to first token b=1 (ms) | peak memory (MB) |", "|---|---|---|"]
        for kind, per_batch in summaries.items():
            lines.append(f"| {kind} | {_cell(per_batch[1]['first_token_s'], 1e3, 1)} | "
                         f"{report.results[kind]['peak_memory_mb']:.0f} |")
        lines.append("")
    if report.probes:
        probes = ", ".join(f"{p.name} {p.gbs:.0f}" for p in report.probes)
        roof = report.roofline()
        best = best_bandwidth_gbs(report.probes)
        lines.append(f"Bandwidth (GB/s): {probes}; the roofline uses the best, {best:.0f}. "
                     "Roofline (ours, decode only): " + ", ".join(
                         f"b={b}: {v['fraction']:.1%} of {v['roofline_tok_s']:.0f} tok/s" for b, v in roof.items()))
    if not report.same_prompt():
        lines.append("\n**The engines' prompt ids differ: this comparison is not like for like.**")
    for kind, error in report.errors.items():
        lines.append(f"\n{kind} failed:\n```\n{error[-1500:]}\n```")
    return "\n".join(lines) + "\n"


def bench(spec: GpuBenchSpec, out: Path, *, max_load: float = QUIET_LOAD, allow_noisy: bool = False,
          log: Callable[[str], None] = print) -> Path:
    """Run the GPU benchmark, write ``gpu-<model>.json`` (+ ``.md``) under ``out``, return its path.
    Raises ``LimitExceeded`` for noisy CPU runs (the file is written first, marked unpublishable)."""
    with LoadTracker() as tracker:
        report = run(spec, log)
    data, verdict = to_raw(report, tracker, max_load, allow_noisy)
    path = raw.write(out, f"gpu-{spec.model.name}", data, markdown(report))
    log(markdown(report))
    raw.refuse_if_problems(data["problems"], path)
    refuse_if_noisy(verdict, path, allow_noisy)
    return path
