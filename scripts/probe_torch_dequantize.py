"""Diagnostic probe (not a benchmark): a 4-bit product rebuilt by torch at every call (what a
packed weight cost where the Triton kernels cannot run) against the same product dense, at one
row, for the four products of a Qwen2-VL-2B layer (groups of 128, bf16).

    python scripts/probe_torch_dequantize.py --out DIR [--device cpu|cuda] [--repeats 5] [--rounds 3]

Each round times every product both ways (``--repeats`` calls after one untimed, their mean),
the two ways taking turns; the figures are the medians over the rounds. The raw file records
each round's times, the load average before and after it and our share of it (the benchmarks'
quiet rule: enforced for a CPU, recorded for a GPU). Writes ``DIR/torch-dequantize-<device>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeinfer.bench.quiet import LoadTracker, RunLog, judge  # noqa: E402
from edgeinfer.quant.packed import PackedMatrix, dequantize_with_torch  # noqa: E402

PRODUCTS = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


def mean_ms(fn, repeats: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    weights = {}
    for name, (n, k) in PRODUCTS.items():
        w = PackedMatrix(torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device),
                         torch.rand(n, k // 128, dtype=torch.bfloat16, device=device), None, 4, 128, (n, k))
        weights[name] = (w, w.dequantize(torch.bfloat16), torch.randn(1, k, dtype=torch.bfloat16, device=device))
    runs = RunLog()
    record = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "repeats": args.repeats, "rounds": []}
    with LoadTracker() as tracker:
        for round_ in range(args.rounds):
            with runs.run(f"round {round_}") as run:
                for name, (w, dense, x) in weights.items():
                    layout = w.layout
                    run[name] = {
                        "per_call_ms": mean_ms(lambda: x @ dequantize_with_torch(
                            w.codes, w.scales, None, layout, x.dtype).t(), args.repeats, device),
                        "dense_ms": mean_ms(lambda: x @ dense.t(), args.repeats, device)}
            record["rounds"].append(run)
            print(f"[probe] round {round_}: " + ", ".join(
                f"{name} {run[name]['per_call_ms']:.2f} / {run[name]['dense_ms']:.3f} ms" for name in PRODUCTS),
                  flush=True)
    record["quiet"] = judge(runs.records, tracker.share_at, enforced=device.type == "cpu").to_dict()
    record["median_ms"] = {name: {way: statistics.median(r[name][way] for r in record["rounds"])
                                  for way in ("per_call_ms", "dense_ms")} for name in PRODUCTS}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"torch-dequantize-{device.type}.json"
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["median_ms"]), "quiet" if record["quiet"]["publishable"] else "NOT quiet", flush=True)


if __name__ == "__main__":
    main()
