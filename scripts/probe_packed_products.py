"""Diagnostic probe (not a benchmark): the batch-1 products of a Qwen2-VL-2B layer as the fused
decode step runs them, with their prologues (RMSNorm, SiLU·up, residual), every candidate tile,
over 28 distinct weights (the ``lm_head``: one), each timed from one CUDA graph; prints the four
fastest tiles of each product and the sum of each one's fastest over 28 layers.

    python scripts/probe_packed_products.py [qkv,o,gate_up,down,lm_head]

``PROBE_FORMAT`` picks the layers' weights: ``w4`` (the default: 4-bit, groups of 128,
symmetric), ``w4z`` (with zero points), ``w8`` (8-bit, a scale a row: the W8A16 checkpoint's) or
``bf16`` (dense, through ``gemv``); the ``lm_head`` is int8 a row beside the packed formats, bf16
beside bf16. ``PROBE_TILES`` (``rows x columns x warps x split x registers``, comma-separated)
times only those packed tiles. To compare two trees, run it once per tree, each in its own
process, in one device call. Outputs of the runs the docs cite are in docs/results/probes/
(``h200-packed-products-*``)."""
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
FORMAT = os.environ.get("PROBE_FORMAT", "w4")
LAYERS = {"w4": (4, 128, False), "w4z": (4, 128, True), "w8": (8, None, False)}  # bits, group (None: the row), zeros
PRODUCTS = [("qkv", 2048, H, "norm"), ("o", H, H, "res"), ("gate_up", 2 * I, H, "glu"), ("down", H, I, "res"),
            ("lm_head", V, H, "norm")]


def weight(name, n, k):
    """One weight of the product in ``FORMAT`` (the ``lm_head``: int8 a row beside packed layers)."""
    if FORMAT == "bf16":
        return torch.randn(n, k, dtype=torch.bfloat16, device=DEV)
    bits, group, zeros = (8, None, False) if name == "lm_head" else LAYERS[FORMAT]
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.int32)
    scales = (torch.rand(n, k // (group or k)) * 0.01).bfloat16()
    z = torch.randint(0, 1 << bits, scales.shape).bfloat16() if zeros else None
    return PackedMatrix(_pack_columns(codes, bits), scales, z, bits, group or k, (n, k)).to(DEV)


def tiles():
    """The tiles timed: every candidate, or those ``PROBE_TILES`` names (packed formats)."""
    if FORMAT == "bf16":
        return td.GEMV_CANDIDATES
    named = os.environ.get("PROBE_TILES", "").split(",")
    return [c for c in td.PACKED_GEMV_CANDIDATES
            if named == [""] or f"{c.bn}x{c.bk}x{c.warps}x{c.split}x{c.registers}" in named]


if __name__ == "__main__":
    wanted = sys.argv[1].split(",") if len(sys.argv) > 1 else [p[0] for p in PRODUCTS]
    total, t0 = 0.0, time.time()
    workspace = td.SplitWorkspace(DEV)

    def product(x, w, c, **kw):
        if FORMAT == "bf16":
            return td.gemv(x, w, config=c, **kw)
        return td.packed_gemv(x, w, c, workspace=workspace, **kw)

    for name, n, k, prologue in (p for p in PRODUCTS if p[0] in wanted):
        count = 1 if name == "lm_head" else 28
        torch.manual_seed(0)
        ws = [weight(name, n, k) for _ in range(count)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
        if prologue in ("norm", "glu"):
            kw = dict(norm_weight=torch.rand(k, dtype=torch.bfloat16, device=DEV), eps=1e-6, glu=prologue == "glu")
        else:
            kw = dict(residual=torch.randn(1, n, dtype=torch.bfloat16, device=DEV))
        us = {c: graph_time_us([lambda w=w, c=c: product(x, w, c, **kw) for w in ws], repeats=10) for c in tiles()}
        best = sorted(us, key=us.get)
        total += us[best[0]] * count
        mb = (ws[0].nbytes if FORMAT != "bf16" else ws[0].numel() * 2) / 1e6
        fields = ("bn", "bk", "warps", "split", "registers")  # a dense tile has no split or register cap
        print(json.dumps({"product": name, "format": FORMAT, "best": [
            [*(getattr(c, f, None) for f in fields), round(us[c], 2)] for c in best[:4]], "mb": mb,
            "elapsed_s": round(time.time() - t0)}), flush=True)
    print(json.dumps({"total_us": round(total, 1)}), flush=True)
