"""Serving benchmark: many requests through the engine the daemon runs (``AsyncEngine``),
timed as a client sees them.

One engine, one run, three parts:

- **burst**: ``burst`` requests submitted at once (a distinct picture each; prepared first,
  so that they reach the engine together, then submitted in one instant): whole-request
  throughput (all tokens over the wall time from the submission to the last answer) and the
  first token's p50 and max;
- **first seen**: ``first_seen`` requests at once (prepared first), twice: the wall time of the first time
  this batch size runs against the second (compilation or graph capture on live traffic
  shows as a ratio above 1);
- **open loop**: Poisson arrivals at each rate in turn (a distinct picture per request, a
  share of them sampled, the rest greedy), ``requests`` per rate, until the engine
  saturates (requests refused, or the first token's p99 over ``ttft_slo_s``): throughput,
  first token p50/p99, the gap between streamed pieces p50/p99 (a burst of tokens arrives
  as one piece, so the gaps are what a streaming client sees), refusals.

Ours only: transformers has no serving loop, so this benchmark has no peer; its
per-request figures against transformers are ``edgeinfer bench gpu``'s. Every figure is
over all the requests of its part (percentiles of all of them, no best run).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgeinfer.bench import raw
from edgeinfer.bench.common import bench_image, environment
from edgeinfer.bench.quiet import RunLog
from edgeinfer.errors import CapacityError, EdgeInferError

QUESTION = "Describe this image."
SAMPLED = {"temperature": 0.7, "top_p": 0.9}


@dataclass(frozen=True)
class ServeBenchSpec:
    model: Path
    profile: str = "cuda"
    overrides: tuple[str, ...] = ()
    image_size: tuple[int, int] = (1024, 768)
    new_tokens: int = 128
    burst: int = 32  # requests of the burst part (0: skip it)
    first_seen: int = 8  # requests of the first-seen part (0: skip it)
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # open-loop arrivals per second
    requests: int = 64  # per rate
    sampled_share: float = 0.5
    ttft_slo_s: float = 2.0  # the open loop stops after the first rate whose first-token p99 passes this
    seed: int = 0

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.requests < 1 or self.burst < 0 or self.first_seen < 0:
            raise ValueError("new_tokens and requests must be >= 1, burst and first_seen >= 0")
        if not 0.0 <= self.sampled_share <= 1.0:
            raise ValueError(f"sampled_share must be in [0, 1], got {self.sampled_share}")
        if any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "model": str(self.model)}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` by linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low, high = math.floor(at), math.ceil(at)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """``n`` Poisson arrival times (seconds from 0) at ``rate`` per second, the same for a seed."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


class _Requests:
    """Distinct pictures, greedy and sampled rows mixed in a fixed pattern per seed."""

    def __init__(self, spec: ServeBenchSpec) -> None:
        self.spec = spec
        self.count = 0
        self._rng = random.Random(spec.seed)

    def next(self):
        from edgeinfer.engine import SamplingParams
        from edgeinfer.engine.async_engine import GenerationRequest

        spec, i = self.spec, self.count
        self.count += 1
        sampled = self._rng.random() < spec.sampled_share
        extra = {**SAMPLED, "seed": spec.seed * 100_003 + i} if sampled else {}
        params = SamplingParams(max_new_tokens=spec.new_tokens, ignore_eos=True, **extra)
        picture = bench_image(spec.image_size, seed=spec.seed * 100_003 + i + 1)
        return GenerationRequest(QUESTION, (picture,), params), sampled


async def _client(aengine, request, sampled: bool, start_at: float) -> dict[str, Any]:
    """Submit ``request`` at ``start_at`` (event-loop time) and record what the client sees.
    An unprepared request is prepared after it arrives, as the daemon does (tokenized and
    its pictures processed off the engine thread), inside its time to first token."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    started = time.perf_counter()
    record: dict[str, Any] = {"sampled": sampled, "late_s": max(0.0, loop.time() - start_at)}
    stamps: list[float] = []
    try:
        if request.prepared is None:
            request = await aengine.prepare(request)
        handle = aengine.submit(request)
        async for _ in handle.deltas():
            stamps.append(time.perf_counter())
        tokens = len(handle.completion.result.token_ids)
        timings = handle.seq.timings  # the engine thread's own (host) times: where the first token's time went
        record.update(vision_s=timings.vision_s, prefill_s=timings.prefill_s)
    except CapacityError as error:
        return {**record, "refused": error.code}
    except EdgeInferError as error:
        return {**record, "error": f"{error.code}: {error}"}
    ended = time.perf_counter()
    return {**record, "started": started, "ended": ended, "tokens": tokens,
            "ttft_s": stamps[0] - started if stamps else None,
            "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])], "total_s": ended - started}


async def _run_part(aengine, make, at: list[float], prepared: bool = False) -> tuple[list[dict[str, Any]], float]:
    """Clients at offsets ``at`` (seconds from now); their records and the part's wall time.
    ``prepared``: every request is prepared before the part starts (a burst's requests then
    reach the engine in one instant)."""
    loop = asyncio.get_running_loop()
    requests = [make() for _ in at]
    if prepared:
        requests = [(await aengine.prepare(r), s) for r, s in requests]
    base = loop.time() + 0.01
    began = time.perf_counter()
    records = await asyncio.gather(*(_client(aengine, r, s, base + t) for (r, s), t in zip(requests, at)))
    return list(records), time.perf_counter() - began


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles over the answered requests of one part."""
    done = [r for r in records if "tokens" in r]
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    gaps = [g for r in done for g in r["gaps_s"]]
    tokens = sum(r["tokens"] for r in done)
    span = (max(r["ended"] for r in done) - min(r["started"] for r in done)) if done else 0.0
    return {"requests": len(records), "answered": len(done),
            "refused": sum("refused" in r for r in records), "failed": sum("error" in r for r in records),
            "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / span if span > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "ttft_max_s": max(ttft) if ttft else None,
            "gap_p50_s": percentile(gaps, 50), "gap_p99_s": percentile(gaps, 99),
            "vision_p50_s": percentile([r["vision_s"] for r in done], 50),
            "prefill_p50_s": percentile([r["prefill_s"] for r in done], 50),
            "sampled": sum(r["sampled"] for r in records)}


def compile_state(engine) -> dict[str, int]:
    """What the engine has compiled, captured and tuned so far: torch's compiled graphs in this
    process, the decoder's CUDA graphs, the tower's graphs, the packed products' row tiles chosen
    (``kernels.tuned_config``, timed or from the tile cache) and the few-row step's row tiles
    decided. A part that changes these did that work on live traffic."""
    from torch._dynamo.utils import counters

    from edgeinfer.quant.kernels import tuned_choices

    decoder = engine.decoder_engine
    state = getattr(decoder, "capture_state", None)
    state = state() if state is not None else {}
    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "decoder_captures": state.get("captures", 0),
            "tower_graphs": len(getattr(engine.vision_engine, "captured_signatures", ())),
            "packed_tiles_chosen": len(tuned_choices()), "fused_row_tiles": state.get("fused_row_tiles", 0)}


@contextlib.contextmanager
def counting(engine, into: dict[str, Any]):
    """``into["during"]``: how much of :func:`compile_state` the block added."""
    before = compile_state(engine)
    yield
    into["during"] = {k: v - before[k] for k, v in compile_state(engine).items()}


async def _bench(aengine, spec: ServeBenchSpec, say, log: RunLog) -> dict[str, Any]:
    """The three parts; each is one run of ``log`` (its load average before and after)."""
    make = _Requests(spec).next
    parts: dict[str, Any] = {}
    # Warm-up: one request, so loading-time work (first compile of the batch-1 step) is not in any part.
    await _run_part(aengine, make, [0.0])
    if spec.first_seen:
        say(f"[bench serve] first seen: {spec.first_seen} at once, twice")
        first, second = {}, {}
        with log.run("first seen"):
            with counting(aengine.engine, first):
                first.update(summarize(*await _run_part(aengine, make, [0.0] * spec.first_seen, prepared=True)))
            with counting(aengine.engine, second):
                second.update(summarize(*await _run_part(aengine, make, [0.0] * spec.first_seen, prepared=True)))
        parts["first_seen"] = {"first": first, "second": second,
                               "ratio": first["wall_s"] / second["wall_s"] if second["wall_s"] else None}
    if spec.burst:
        say(f"[bench serve] burst: {spec.burst} at once")
        counted: dict[str, Any] = {}
        with log.run("burst"), counting(aengine.engine, counted):
            records, wall = await _run_part(aengine, make, [0.0] * spec.burst, prepared=True)
        parts["burst"] = {"summary": {**summarize(records, wall), **counted}, "records": records}
    open_loop = []
    for i, rate in enumerate(spec.rates):
        say(f"[bench serve] open loop: {rate:g} requests/s, {spec.requests} requests")
        counted = {}
        with log.run(f"open loop {rate:g}/s"), counting(aengine.engine, counted):
            records, wall = await _run_part(aengine, make, arrivals(rate, spec.requests, spec.seed + i))
        summary = {**summarize(records, wall), **counted}
        open_loop.append({"rate": rate, "summary": summary, "records": records})
        p99 = summary["ttft_p99_s"]
        if summary["refused"] or summary["failed"] or p99 is None or p99 > spec.ttft_slo_s:
            say(f"[bench serve] saturated at {rate:g}/s (refused {summary['refused']}, first token p99 {p99})")
            break
    parts["open_loop"] = open_loop
    return parts


def camera_overrides(spec: ServeBenchSpec) -> tuple[str, ...]:
    """The spec's profile overrides, after one that names the pictures' size as the cameras' size
    (``runtime.vision_compile_sizes``), as a deployment names its cameras': the vision tower is
    then compiled and captured for it at start-up. An override of the spec's own comes later and wins."""
    width, height = spec.image_size
    return (f"runtime.vision_compile_sizes=[{width}x{height}]", *spec.overrides)


def bench(spec: ServeBenchSpec, say=print) -> dict[str, Any]:
    from edgeinfer.engine import Engine
    from edgeinfer.engine.async_engine import AsyncEngine, freeze_start_up_objects
    from edgeinfer.profiles import load_profile

    profile = load_profile(spec.profile, camera_overrides(spec))
    started = time.perf_counter()
    engine = Engine.load(spec.model, profile=profile)
    startup = {"load_s": time.perf_counter() - started, "capture": engine.startup_capture,
               "capture_budget_s": profile.runtime.capture_budget_s}
    say(f"[bench serve] ready after {startup['load_s']:.1f} s (graphs captured at start-up: "
        f"{engine.startup_capture})")
    server = profile.server
    aengine = AsyncEngine(engine, max_concurrent=server.max_concurrent, max_queue=server.max_queue).start()
    freeze_start_up_objects()  # as the daemon does once ready
    log = RunLog()
    try:
        parts = asyncio.run(_bench(aengine, spec, say, log))
    finally:
        aengine.close()
    device = profile.runtime.device
    limits = {"max_concurrent": server.max_concurrent, "max_queue": server.max_queue}
    return {**raw.header("serve", spec.to_json(), environment(device)), "limits": limits, "startup": startup,
            "runs": log.records, **parts}


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.0f}"


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _during(summary: dict[str, Any]) -> str:
    """Compilations and captures inside a part (the raw files of older runs have none)."""
    d = summary.get("during")
    if d is None:
        return "–"
    return f"{d['compiled_graphs']} / {d['decoder_captures'] + d['tower_graphs']}"


def markdown(report: dict[str, Any]) -> str:
    lines = []
    if "startup" in report:
        s = report["startup"]
        captured = s["capture"] or {"captured": 0, "planned": 0}
        lines += [f"Start-up to ready: {s['load_s']:.1f} s, of which {captured.get('seconds', 0.0):.1f} s captured "
                  f"{captured['captured']} of {captured['planned']} graphs (budget {s['capture_budget_s']:g} s).",
                  ""]
    if "burst" in report:
        s = report["burst"]["summary"]
        times = ("" if s.get("vision_p50_s") is None else
                 f"; the engine thread's time on each request's picture {_ms(s['vision_p50_s'])} ms and prompt "
                 f"{_ms(s['prefill_p50_s'])} ms (p50; on a GPU the picture's device work ends inside the prompt's time)")
        lines += [f"Burst: {s['requests']} requests at once, {report['spec']['new_tokens']} tokens each: "
                  f"{_rate(s['tokens_per_s'])} tok/s whole requests, first token p50 {_ms(s['ttft_p50_s'])} ms, "
                  f"max {_ms(s['ttft_max_s'])} ms, refused {s['refused']}, failed {s['failed']}{times}; "
                  f"compiled / captured during it: {_during(s)}.", ""]
    if "first_seen" in report:
        f = report["first_seen"]
        ratio = "–" if f["ratio"] is None else f"{f['ratio']:.2f}×"
        lines += [f"First seen: {f['first']['requests']} at once, first time {f['first']['wall_s']:.2f} s, "
                  f"second {f['second']['wall_s']:.2f} s ({ratio}); compiled / captured during each: "
                  f"{_during(f['first'])} and {_during(f['second'])}.", ""]
    lines += ["| arrivals/s | answered | refused | tok/s | first token p50 / p99 (ms) | piece gap p50 / p99 (ms) "
              "| compiled / captured during it |", "|---|---|---|---|---|---|---|"]
    for step in report.get("open_loop", []):
        s = step["summary"]
        lines.append(f"| {step['rate']:g} | {s['answered']}/{s['requests']} | {s['refused']} | "
                     f"{_rate(s['tokens_per_s'])} | {_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p99_s'])} | "
                     f"{_ms(s['gap_p50_s'])} / {_ms(s['gap_p99_s'])} | {_during(s)} |")
    loads = [run["load"]["after"][0] for run in report.get("runs", [])]
    if loads:
        lines += ["", f"1-minute load average after each part: {', '.join(f'{x:.2f}' for x in loads)}."]
    return "\n".join(lines) + "\n"
