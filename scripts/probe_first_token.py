#!/usr/bin/env python3
"""Where a request's first token goes when it comes late: the benchmark's calls, taken apart.

    python scripts/probe_first_token.py --model DIR [--pairs 10] [--new-tokens 64] --out probe.json

Loads the engine as ``edgeinfer bench gpu`` does (same configuration, picture and question)
and makes the benchmark's pairs of calls: ``--new-tokens`` tokens, then one token. For every
call it records the host's first token against the call's start, the engine's own timings
(vision, prefill, time to first token) and every collection of Python's garbage collector
during the call (generation, objects collected, pause, and whether it came before the first
token). The pairs run three times in one process: with the collector as it is, after
``gc.freeze()`` (the objects alive then are never scanned again) and with the collector off.
Prints a JSON object; nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.bench.common import bench_image, sync  # noqa: E402
from edgeinfer.bench.gpu import QUESTION, ours_config  # noqa: E402
from edgeinfer.bench.raw import print_and_save  # noqa: E402
from edgeinfer.engine import Engine, SamplingParams  # noqa: E402
from edgeinfer.profiles import parse_size  # noqa: E402


class Collections:
    """Every collection of the garbage collector, timed: (start, seconds, generation, collected)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, int, int]] = []
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.events.append((self._started, now - self._started, info["generation"], info["collected"]))

    def between(self, start: float, end: float, first: float) -> list[dict]:
        return [{"at_ms": (t - start) * 1e3, "pause_ms": s * 1e3, "generation": g, "collected": c,
                 "before_first_token": t < first}
                for t, s, g, c in self.events if start <= t <= end]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--image-size", default="1024x768")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    size = parse_size(args.image_size)
    engine = Engine.load(args.model, config=ours_config(args.dtype, args.device, size, max_batch=1))
    image = bench_image(size, seed=0)
    collections = Collections()

    def call(new_tokens: int) -> dict:
        engine.vision_cache.clear()
        sync(args.device)
        started = time.perf_counter()
        seq = engine.submit(QUESTION, [image], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        submitted = time.perf_counter()
        result = engine.run_until_done([seq])[0]
        sync(args.device)
        ended = time.perf_counter()
        first = seq.timings.first_token
        return {"new_tokens": new_tokens, "call_ms": (ended - started) * 1e3, "submit_ms": (submitted - started) * 1e3,
                "first_token_ms": (first - started) * 1e3,
                "engine": {k: None if v is None else v * 1e3 for k, v in result.timings.items()
                           if k in ("vision_s", "prefill_s", "ttft_s", "total_s")},
                "collections": collections.between(started, ended, first)}

    def pairs(label: str) -> dict:
        calls = []
        for _ in range(2):  # untimed, as the benchmark's warm-ups
            call(args.new_tokens), call(1)
        for _ in range(args.pairs):
            calls += [call(args.new_tokens), call(1)]
        full = [c for c in calls if c["new_tokens"] == args.new_tokens]
        one = [c for c in calls if c["new_tokens"] == 1]
        return {"collector": label, "calls": calls,
                "first_token_ms_full": statistics.median(c["first_token_ms"] for c in full),
                "first_token_ms_one": statistics.median(c["first_token_ms"] for c in one),
                "late_full": sum(c["first_token_ms"] > 1.2 * min(x["first_token_ms"] for x in one) for c in full),
                "collections_before_first_token": sum(e["before_first_token"] for c in calls for e in c["collections"])}

    out = {"model": str(args.model), "image": list(size), "new_tokens": args.new_tokens,
           "gc_thresholds": gc.get_threshold(), "tracked_objects": len(gc.get_objects())}
    runs = [pairs("default")]
    gc.collect()
    gc.freeze()
    out["frozen_objects"] = gc.get_freeze_count()
    runs.append(pairs("frozen"))
    gc.disable()
    runs.append(pairs("disabled"))
    gc.enable()
    out["runs"] = runs
    print_and_save(out, args.out)
    for r in runs:
        print(r["collector"], "first token full/one (ms):", round(r["first_token_ms_full"], 1),
              round(r["first_token_ms_one"], 1), "late:", r["late_full"], "of", args.pairs,
              "collections before a first token:", r["collections_before_first_token"], file=sys.stderr)


if __name__ == "__main__":
    main()
