"""Diagnostic probe (not a benchmark): the batch-1 packed product with a thread's words side by side
(``PackedGemvConfig.vec`` 4: one 16-byte load for four words of a row) beside one word a thread (the
tiles the step has timed so far), on a GPU.

    OUT=folder python scripts/probe_packed_gemv_words.py [gate_up,down,qkv,o]

Why: under Nsight Compute every 4-bit product keeps DRAM at 19-31% of its peak, where the bf16 GEMV of
the same layers, whose threads load 16 bytes at a time, reaches 63-72%
(docs/results/probes/h100-ncu-staged). At one word a thread a 4-bit step asks for its words four
bytes a load.

Each product of a Qwen2-VL-2B layer, 4-bit g128 symmetric bf16 scales, with what the step fuses into
it, over 28 copies of its weight (one a layer, so reads come from memory as in a step), from one CUDA
graph a tile. Every tile of ``PACKED_GEMV_CANDIDATES`` both ways; each first checked as the tuner checks
it (``triton_decode.right_tiles``), a tile outside its bounds named and not timed. The tiles take
turns, ``ROUNDS`` rounds; medians. Writes ``$OUT/probe-packed-gemv-words.json`` (load averages before
and after).
"""
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import triton

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.products import fused_inputs, random_packed

LAYERS, GS = 28, 128
PRODUCTS = {"gate_up": (17920, 1536, "norm+glu"), "down": (1536, 8960, "residual"),
            "qkv": (2048, 1536, "norm+bias"), "o": (1536, 1536, "residual")}  # N, K, what the step fuses


def product(which: str, rounds: int) -> dict:
    dev = torch.device("cuda")
    n, k, kind = PRODUCTS[which]
    torch.manual_seed(0)
    ws = [random_packed(n, k, 4, GS, dev) for _ in range(LAYERS)]
    x, kw = fused_inputs(kind, n, k, dev)
    outs = [torch.empty(1, n // 2 if kw.get("glu") else n, dtype=x.dtype, device=dev) for _ in ws]
    space = SplitWorkspace(dev)
    tiles = [dataclasses.replace(c, vec=v) for c in td.PACKED_GEMV_CANDIDATES for v in (1, 4)]
    t0 = time.time()
    kernels.compile_ahead([lambda c=c: td.packed_gemv(x, ws[0], c, out=outs[0], workspace=space, warmup=True, **kw)
                           for c in tiles])
    row = {"n": n, "k": k, "fuses": kind, "compile_s": round(time.time() - t0, 1)}
    right, row["wrong"] = td.right_tiles(x, ws[0], tiles, outs[0],
                                         lambda _x, w, c, out, **k2: td.packed_gemv(_x, w, c, out=out, workspace=space,
                                                                                    **k2), **kw)
    times = {c: [] for c in right}
    for _ in range(rounds):
        for c in right:
            times[c].append(kernels.graph_time_us(
                [lambda w=w, o=o, c=c: td.packed_gemv(x, w, c, out=o, workspace=space, **kw) for w, o in zip(ws, outs)],
                10))
    row["us"] = {td._config_name(c): round(statistics.median(t), 2) for c, t in times.items()}
    for v in (1, 4):
        mine = {c: statistics.median(t) for c, t in times.items() if c.vec == v}
        best = min(mine, key=mine.get)
        row[f"best_vec{v}"] = [td._config_name(best), round(mine[best], 2)]
    return row


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(PRODUCTS)
    rounds = int(os.environ.get("ROUNDS", "3"))
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "rounds": rounds, "loadavg_before": os.getloadavg()}
    for name in names:
        res[name] = product(name, rounds)
        print(name, json.dumps({k: v for k, v in res[name].items() if k.startswith(("best", "compile", "wrong"))}),
              flush=True)
        res["loadavg_after"] = os.getloadavg()
        with open(os.path.join(os.environ.get("OUT", "."), "probe-packed-gemv-words.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
