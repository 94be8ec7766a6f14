#!/usr/bin/env python3
"""Where the time of one request goes on a GPU: preprocessing, the vision tower, prefill, decode steps.

    python scripts/profile_gpu.py --model DIR [--image-size 1024x768] [--steps 64] [--batch 1] --out profile.json
    python scripts/profile_gpu.py --shape qwen2-vl-2b --weights w4a16-h8 --cache DIR --batch 16 --out profile.json

``--shape`` (with ``--weights``, the checkpoint as it is by default, and ``--cache``) profiles the
checkpoint ``edgeinfer bench gpu`` runs for that shape and weight format, built and quantized
under ``--cache`` the first time, as the benchmark builds them.

Decode is the engine's time per step (a token of every row; wall time under cProfile, host
included, greedy bursts as the engine runs them) and the kernels of one burst step
(``burst_step_kernels``: device time per kernel), then the device's timeline over as many more
steps (``decode_timeline``: the time some kernel ran against the wall, the gaps between kernels,
and each kernel's device time a step, ``by_kernel``). ``--batch B`` decodes B requests at once,
each with its own picture (the preprocessing and vision sections take the first). Where a
single-step graph was captured (bursts off, or sampled rows), its replay alone is timed too
(``graph_replay_ms``, replays back to back). The vision tower is readied for the image's size at load (as a profile's
``vision_compile_sizes`` do: captured in a CUDA graph, or compiled) and timed so and
eagerly, its kernels listed with ``torch.profiler``. Prints a JSON object; nothing here is
a pass/fail check.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.bench.common import CACHE_ENV, DEFAULT_CACHE, SHAPES, bench_checkpoint, bench_image  # noqa: E402
from edgeinfer.bench.gpu import QUESTION, ours_config  # noqa: E402
from edgeinfer.bench.raw import print_and_save  # noqa: E402
from edgeinfer.bench.weights import check_weights, dense_format, format_checkpoint  # noqa: E402
from edgeinfer.engine import Engine, SamplingParams  # noqa: E402
from edgeinfer.profiles import parse_size  # noqa: E402
from edgeinfer.quant.kernels import replay_ms  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` with the device synchronised around it."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_table(fn, top: int = 25) -> dict:
    """Device kernels of ``fn()`` (``torch.profiler``, CUDA activity): count and time per kernel name,
    the total kernel time and the wall time around it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(e.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time
    total = sum(v[1] for v in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"wall_ms": wall * 1e3, "kernel_ms": total / 1e3, "kernels": sum(v[0] for v in kernels.values()),
            "top": [{"name": n, "count": c, "ms": round(t / 1e3, 4)} for n, (c, t) in rows]}


def decoded(seqs) -> int:
    """Steps every one of ``seqs`` has decoded: the fewest tokens any of them has."""
    return min(len(s.generated) for s in seqs)


def decode_timeline(engine, seqs, steps: int, top: int = 12) -> dict:
    """The device's timeline while the engine decodes ``steps`` steps of ``seqs`` (``torch.profiler``,
    CUDA activity only, no host profiler): see :func:`timeline`."""
    from torch.profiler import ProfilerActivity, profile

    before = decoded(seqs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        while decoded(seqs) - before < steps:
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    done = decoded(seqs) - before
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"batch": len(seqs), **timeline(spans, wall * 1e6, done, top)}


def timeline(spans: list[tuple[float, float, str]], wall_us: float, steps: int, top: int = 12) -> dict:
    """Figures of a device timeline (``spans``: each kernel's start, end in µs and name) over
    ``steps`` decode steps that took ``wall_us``: the time some kernel ran (their union, ``busy``),
    the gaps between one kernel's end and the next one's start (the longest with the kernels on
    each side), and each kernel name's count and device time a step, most first (``by_kernel``).
    "A token" is a step: a token of every row."""
    spans = sorted((start, stop, name[:70]) for start, stop, name in spans)
    per = max(steps, 1)
    gaps, end, last = [], None, None  # end: the latest a kernel so far ran to (kernels may overlap)
    by_name: dict[str, list[float]] = {}
    for start, stop, name in spans:
        if end is not None and start >= end:  # touching kernels count, as a gap of 0
            gaps.append((start - end, last, name))
        if end is None or stop > end:
            end, last = stop, name
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += stop - start
    sizes = sorted(g[0] for g in gaps)
    span = end - spans[0][0] if spans else 0.0
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"tokens": steps, "wall_ms": wall_us / 1e3, "wall_us_a_token": wall_us / per,
            "kernels": len(spans), "busy_us_a_token": (span - sum(sizes)) / per, "span_us_a_token": span / per,
            "gaps": len(gaps), "gap_us_a_token": sum(sizes) / per,
            "gaps_over_5us": sum(1 for g in sizes if g > 5), "gap_us_over_5us": sum(g for g in sizes if g > 5),
            "gap_median_us": statistics.median(sizes) if sizes else None,
            "longest": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:top]],
            "by_kernel": [{"name": n, "count_a_token": c / per, "us_a_token": round(t / per, 2)}
                          for n, (c, t) in kernels]}


def at_batch(graphs: dict, batch: int):
    """The graph of the smallest batch bucket that holds ``batch`` rows (keys start with the
    bucket), or None."""
    bucket = min((key[0] for key in graphs if key[0] >= batch), default=None)
    return next((g for key, g in graphs.items() if key[0] == bucket), None)


def shape_checkpoint(shape: str, fmt: str, cache: Path, group_size: int, dtype: str) -> Path:
    """The checkpoint ``bench gpu --shape SHAPE --weights FMT`` runs, built (and quantized) under
    ``cache`` the first time."""
    return format_checkpoint(bench_checkpoint(shape, cache), fmt, cache, group_size, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", type=Path)
    which.add_argument("--shape", choices=sorted(SHAPES), help="the benchmarks' random checkpoint of this shape")
    parser.add_argument("--weights", default=None, help="with --shape: a format of `bench gpu --weights` "
                                                         "(default: the checkpoint as it is)")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE)),
                        help=f"with --shape: where its checkpoints are built once (default: ${CACHE_ENV}, "
                             "else the benchmarks' own)")
    parser.add_argument("--group-size", type=int, default=128, help="with --shape: the quantized formats' group")
    parser.add_argument("--image-size", default="1024x768")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="requests decoded at once, each with its own picture")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.model is not None and args.weights is not None:
        parser.error("--weights goes with --shape: a --model folder is profiled as it is")
    fmt = None
    if args.shape is not None:
        try:
            fmt = args.weights or dense_format(args.dtype)
            check_weights((fmt,), args.dtype)
        except ValueError as error:
            parser.error(str(error))
    if not torch.cuda.is_available():
        sys.exit("profile_gpu: no CUDA device is visible to torch")
    model = args.model or shape_checkpoint(args.shape, fmt, args.cache, args.group_size, args.dtype)
    w, h = parse_size(args.image_size)
    images = [bench_image((w, h), seed=i) for i in range(args.batch)]
    image = images[0]
    # As `bench gpu --batch-sizes 1,16` loads ours, or for the larger batch asked for.
    engine = Engine.load(model, config=ours_config(args.dtype, "cuda", (w, h), max(16, args.batch)))
    params = SamplingParams(max_new_tokens=4 * args.steps + 1, ignore_eos=True)
    for _ in range(2):  # warm-up: graphs captured, layers compiled
        engine.vision_cache.clear()
        engine.run_until_done([engine.submit(QUESTION, [picture], params) for picture in images])
    out: dict = {"model": str(model), "image": [w, h], "batch": args.batch, "gpu": torch.cuda.get_device_name()}

    # Preprocessing and the vision tower.
    adapter = engine.adapter
    processed = adapter.process_image(image)
    out["preprocess_s"] = timed(lambda: adapter.process_image(image), 5)
    out["vision_tokens"] = processed.num_tokens
    tower = engine.vision_engine
    out["vision_s"] = timed(lambda: tower.encode(processed.tensors), 5)  # compiled for this size at load
    out["vision_compiled"] = bool(getattr(tower, "compiled_signatures", None))
    out["vision_captured"] = bool(getattr(tower, "captured_signatures", None))
    out["vision_eager_s"] = timed(lambda: tower._run(tower.module, processed.tensors), 5)
    out["vision_kernels"] = kernel_table(lambda: tower.encode(processed.tensors))

    # The requests, step by step; where the host's time goes in submit (preprocessing, hashing, prompt).
    engine.vision_cache.clear()
    from torch._dynamo.utils import counters

    graphs_before = dict(counters["stats"])
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    profiler.enable()
    seqs = [engine.submit(QUESTION, [picture], params) for picture in images]
    seq = seqs[0]
    profiler.disable()
    out["submit_s"] = time.perf_counter() - t0
    out["dynamo_stats_during_submit"] = {k: v - graphs_before.get(k, 0) for k, v in counters["stats"].items()}
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("cumtime").print_stats(20)
    out["submit_profile_top"] = stream.getvalue().splitlines()[:45]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while not all(s.generated for s in seqs):
        engine.step()
    torch.cuda.synchronize()
    out["prefill_s"] = seq.timings.prefill_s
    out["submit_to_first_token_s"] = time.perf_counter() - t0 + seq.timings.vision_s
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    before = decoded(seqs)
    t0 = time.perf_counter()
    profiler.enable()
    while decoded(seqs) - before < args.steps:
        engine.step()
    profiler.disable()
    torch.cuda.synchronize()
    out["decode_step_wall_ms"] = (time.perf_counter() - t0) / (decoded(seqs) - before) * 1e3
    out["decode_bursts"] = engine.counters["decode_bursts"]
    out["weight_layout"] = getattr(engine.decoder_engine, "weight_layout", None)
    out["decode_kernels"] = getattr(engine.decoder_engine, "kernel_report", None)
    out["compile_error"] = getattr(engine.decoder_engine, "compile_error", None)
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(25)
    out["host_profile_top"] = stream.getvalue().splitlines()[:60]

    # The same sequences decode on, now with the device's timeline recorded and no host profiler.
    out["decode_timeline"] = decode_timeline(engine, seqs, args.steps)

    one = at_batch(getattr(engine.decoder_engine, "_graphs", {}), args.batch)
    if one is not None:
        out["graph_replay_ms"] = replay_ms(one.graph, 100)
        out["host_added_ms"] = out["decode_step_wall_ms"] - out["graph_replay_ms"]
    burst = at_batch(getattr(engine.decoder_engine, "_bursts", {}), args.batch)
    if burst is not None and hasattr(burst.replay, "__self__"):
        # Replays of the greedy graph write into the pool at these sequences' next slots,
        # which their tables cover; the sequences are not used afterwards.
        out["burst_step_kernels"] = kernel_table(burst.replay, top=40)
    decoder = engine.model.decoder
    out["text_weight_bytes"] = sum(p.numel() * p.element_size() for n, p in decoder.named_parameters() if n != "embed")
    print_and_save(out, args.out)


if __name__ == "__main__":
    main()
