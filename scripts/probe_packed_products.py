"""Diagnostic probe (not a benchmark): the batch-1 packed products of a Qwen2-VL-2B layer as the
fused decode step runs them, with their prologues (RMSNorm, SiLU·up, residual), every candidate
tile of ``PACKED_GEMV_CANDIDATES``, over 28 distinct 4-bit g128 weights (the int8 ``lm_head``:
one), each timed from one CUDA graph; prints the four fastest tiles of each product and the sum
of each one's fastest over 28 layers.

    python scripts/probe_packed_products.py [qkv,o,gate_up,down,lm_head]

``PROBE_TILES`` (``rows x columns x warps x split x registers``, comma-separated) times only those
tiles; ``PROBE_BITS=8`` makes the layers' products 8-bit, a scale a row (the W8A16 checkpoint's). To compare two trees, run it once per tree, each in its own process, in one device call.
Outputs of the runs the docs cite are in docs/results/probes/ (``h200-packed-products-*``)."""
import json
import os
import sys
import time

import torch

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.backends.torch.triton_decode import graph_time_us
from edgeinfer.quant.packed import PackedMatrix, _pack_columns

DEV = torch.device("cuda")
H, I, V = 1536, 8960, 151936
EIGHT = os.environ.get("PROBE_BITS") == "8"
BITS, GROUP = (8, None) if EIGHT else (4, 128)  # None: the row's length
PRODUCTS = [("qkv", 2048, H, "norm"), ("o", H, H, "res"), ("gate_up", 2 * I, H, "glu"), ("down", H, I, "res")]
PRODUCTS = [(name, n, k, prologue, BITS, GROUP or k) for name, n, k, prologue in PRODUCTS] + [
    ("lm_head", V, H, "norm", 8, H)]


def packed(n, k, bits, group):
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.int32)
    scales = (torch.rand(n, k // group) * 0.01).bfloat16()
    return PackedMatrix(_pack_columns(codes, bits), scales, None, bits, group, (n, k)).to(DEV)


def tile_name(c):
    return f"{c.bn}x{c.bk}x{c.warps}x{c.split}x{c.registers}"


if __name__ == "__main__":
    wanted = sys.argv[1].split(",") if len(sys.argv) > 1 else [p[0] for p in PRODUCTS]
    tiles = os.environ.get("PROBE_TILES", "").split(",")
    candidates = [c for c in td.PACKED_GEMV_CANDIDATES if tiles == [""] or tile_name(c) in tiles]
    total, t0 = 0.0, time.time()
    for name, n, k, prologue, bits, group in (p for p in PRODUCTS if p[0] in wanted):
        count = 1 if name == "lm_head" else 28
        torch.manual_seed(0)
        weights = [packed(n, k, bits, group) for _ in range(count)]
        workspace = td.SplitWorkspace(DEV)
        x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
        if prologue in ("norm", "glu"):
            kw = dict(norm_weight=torch.rand(k, dtype=torch.bfloat16, device=DEV), eps=1e-6, glu=prologue == "glu")
        else:
            kw = dict(residual=torch.randn(1, n, dtype=torch.bfloat16, device=DEV))
        us = {c: graph_time_us([lambda w=w, c=c: td.packed_gemv(x, w, c, workspace=workspace, **kw) for w in weights],
                               repeats=10) for c in candidates}
        best = sorted(us, key=us.get)
        total += us[best[0]] * count
        print(json.dumps({"product": name, "bits": bits, "best": [[c.bn, c.bk, c.warps, c.split, c.registers,
                                                                    round(us[c], 2)] for c in best[:4]],
                          "mb": weights[0].nbytes / 1e6, "elapsed_s": round(time.time() - t0)}), flush=True)
    print(json.dumps({"total_us": round(total, 1)}), flush=True)
