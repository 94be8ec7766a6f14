#!/usr/bin/env python3
"""Where a burst's time goes on a GPU: the device's work per stream while many requests enter at once,
and each part of a request alone.

    python scripts/profile_serve.py --model DIR [--set key=value ...] [--burst 32] --out DIR

The engine is loaded as ``bench serve`` loads it (the ``cuda`` profile, the pictures' size as the
cameras' size, the overrides given) and driven by the daemon's ``AsyncEngine``. A burst of
``--burst`` requests (distinct 1024x768 pictures, ``--new-tokens`` each, greedy) runs once under
``torch.profiler``; from its trace: each CUDA stream's kernel time and busy time, the time both
streams were busy at once, the device's idle time inside the burst, the host threads' time blocked
in CUDA calls, the costliest kernels of each stream and its busy blocks in order (kernels less than
0.3 ms apart joined: a picture, a prompt, a decode step). Writes ``profile-serve.json`` and the
trace (``trace.json.gz``) into ``--out``; nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.bench.common import bench_image, environment  # noqa: E402
from edgeinfer.bench.serve import QUESTION  # noqa: E402
from edgeinfer.engine import Engine, SamplingParams  # noqa: E402
from edgeinfer.engine.async_engine import AsyncEngine, GenerationRequest  # noqa: E402
from edgeinfer.profiles import load_profile  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
              "cudaStreamWaitEvent", "cudaGraphLaunch")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def blocks(kernels: list[dict], origin: float, gap_us: float = 300.0) -> list[list[float]]:
    """[start, end, busy] milliseconds from ``origin`` of runs of ``kernels`` less than ``gap_us`` apart."""
    out: list[list[float]] = []
    for start, end in sorted((e["ts"] - origin, e["ts"] - origin + e["dur"]) for e in kernels):
        if out and start - out[-1][1] < gap_us:
            out[-1][1], out[-1][2] = max(out[-1][1], end), out[-1][2] + end - start
        else:
            out.append([start, end, end - start])
    return [[round(a / 1e3, 2), round(b / 1e3, 2), round(c / 1e3, 2)] for a, b, c in out]


def trace_summary(path: Path, top: int = 12) -> dict:
    """Per-stream kernel figures and the host's blocked time, in milliseconds, from a chrome trace."""
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"error": "the trace holds no kernels"}
    by_stream: dict[int, list[dict]] = defaultdict(list)
    for e in kernels:
        by_stream[int(e.get("args", {}).get("stream", -1))].append(e)
    span = (min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels))
    busy = {s: union([(e["ts"], e["ts"] + e["dur"]) for e in es]) for s, es in by_stream.items()}
    streams = {}
    for s, es in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in es:
            names[e["name"][:100]][0] += 1
            names[e["name"][:100]][1] += e["dur"]
        streams[str(s)] = {"kernels": len(es), "kernel_ms": sum(e["dur"] for e in es) / 1e3,
                           "busy_ms": covered(busy[s]) / 1e3, "blocks": blocks(es, span[0])[:80],
                           "top": [{"name": n, "count": c, "ms": round(t / 1e3, 3)}
                                   for n, (c, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]]}
    everything = union([iv for ivs in busy.values() for iv in ivs])
    ordered = sorted(busy, key=lambda s: -covered(busy[s]))
    both = overlap(busy[ordered[0]], busy[ordered[1]]) / 1e3 if len(ordered) > 1 else 0.0
    blocked: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS and "dur" in e:
            blocked[str(e.get("tid"))][e["name"]] += e["dur"] / 1e3
    return {"span_ms": (span[1] - span[0]) / 1e3, "device_busy_ms": covered(everything) / 1e3,
            "device_idle_ms": (span[1] - span[0] - covered(everything)) / 1e3, "two_streams_busy_ms": both,
            "streams": streams, "host_calls_ms": {t: dict(v) for t, v in blocked.items()}}


async def burst(aengine: AsyncEngine, requests: list[GenerationRequest]) -> list:
    prepared = [await aengine.prepare(r) for r in requests]
    handles = aengine.submit_many(prepared)
    return [await h.result() for h in handles]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    size = (1024, 768)
    profile = load_profile("cuda", (f"runtime.vision_compile_sizes=[{size[0]}x{size[1]}]", *args.overrides))
    engine = Engine.load(args.model, profile=profile)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    pictures = iter(range(1, 10_000))  # a distinct picture per request
    make = lambda: GenerationRequest(QUESTION, (bench_image(size, seed=next(pictures)),), params)  # noqa: E731
    report: dict = {"environment": environment("cuda"), "overrides": args.overrides, "burst": args.burst}

    aengine = AsyncEngine(engine, max_concurrent=args.burst, max_queue=args.burst).start()
    try:
        asyncio.run(burst(aengine, [make() for _ in range(2)]))  # warm-up
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            done = asyncio.run(burst(aengine, [make() for _ in range(args.burst)]))
            torch.cuda.synchronize()
            report["burst_wall_ms"] = (time.perf_counter() - t0) * 1e3
        report["burst_ttft_ms"] = sorted(c.stats.ttft_s * 1e3 for c in done)
    finally:
        aengine.close()
    trace = args.out / "trace.json"
    prof.export_chrome_trace(str(trace))
    report["trace"] = trace_summary(trace)
    with trace.open("rb") as src, gzip.open(args.out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()

    path = args.out / "profile-serve.json"
    path.write_text(json.dumps(report, indent=1))
    brief = {**report["trace"], "streams": {s: {k: v for k, v in st.items() if k != "blocks"}
                                             for s, st in report["trace"].get("streams", {}).items()}}
    print(json.dumps({"burst_wall_ms": report["burst_wall_ms"], "ttft_ms": report["burst_ttft_ms"], **brief},
                     indent=1)[:8000])


if __name__ == "__main__":
    main()
