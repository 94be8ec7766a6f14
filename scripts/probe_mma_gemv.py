"""Diagnostic probe (not a benchmark): a batch-1 4-bit product on the tensor cores, beside the
batch-1 product the decode step runs (``triton_decode.packed_gemv``), on a GPU.

    OUT=folder python scripts/probe_mma_gemv.py [gate_up,down,qkv,o]

The decode step's ``packed_gemv`` spends 35-42 instructions a packed word of its K step
(docs/gpu-kernels.md): a shift, an ``lop3`` and a float32 multiply-add for each of a word's
eight values, and x, the scales and the addresses around them. Here (Gluon, Triton's explicit
layouts) each word becomes its eight values as bf16 128 + q in four ``lop3`` and three shifts, two
to a register, already in the layout ``mma.sync`` m16n8k16 reads its A operand from, and the
tensor cores multiply them by x with float32 sums: about 15 instructions a word in the sm_90
binary. How it is laid out:

- A warp takes 16 rows (the MMA's M). A lane holds four consecutive words (16 bytes, one load) of
  two rows, g and g + 8, in each group of 128 columns. The MMA's K order is a permutation of the
  columns (each thread's eight values of a 32-column block are one word; a lane's four words are
  the four blocks of the group), and x is read in the same permutation: a sum over K does not
  care about its order.
- x is the B operand, the same in all 8 of the MMA's N columns; a second MMA of a constant -136
  by x takes off each group's 128 + 8 (the bf16 bias and the symmetric zero point), and the
  group's scale multiplies the group's sums (float32) in the accumulator.
- Every group's words of a program's share of K are asked for before the first is used; ``ptxas``
  still orders the loads as it likes, unless ``hoisted``: the first group's words then depend on
  all of them (see ``HOIST``), and a thread's loads all go out before its first multiply.
- K split ``split`` ways: each split stores its partials and the last to arrive adds them in
  split order (``kernels.split_total``'s protocol), so the sum does not depend on who is last.

Weights are random codes with bf16 scales, groups of 128, symmetric (the benchmark's W4A16), 28
copies of each product (one per layer, so that reads come from memory as in a step); both kernels
run without prologue or epilogue (a plain product, bf16 out) and are timed from one CUDA graph
per tile (``kernels.graph_time_us``), every tile of both, in one process. Each output is checked
against the product with the weight dequantized to bf16 (float32 sums): largest difference over
the largest output. Writes ``$OUT/probe-mma-gemv.json``.
"""
import json
import os
import sys
import time
import traceback

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels, launching
from edgeinfer.quant.packed import PackedMatrix
# the A operand from a chunk's words, x as the B operand, and their layouts: written for this probe,
# now the staged kernel's (edgeinfer.quant.staged), which reuses this arithmetic
from edgeinfer.quant.staged import a_operand as _a_operand
from edgeinfer.quant.staged import b_operand as _b_operand
from edgeinfer.quant.staged import mma_layout as _mma_layout
from edgeinfer.quant.staged import word_layout as _word_layout
from edgeinfer.quant.staged import x_layout as _x_layout
from edgeinfer.testing.products import random_packed

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
LAYERS, GS = 28, 128
PRODUCTS = {"gate_up": (17920, 1536, (1, 2, 3, 4, 6)), "down": (1536, 8960, (5, 7, 10, 14, 35)),
            "qkv": (2048, 1536, (1, 2, 3, 4, 6)), "o": (1536, 1536, (1, 2, 3, 4, 6))}  # N, K, splits tried
WARPS = (1, 4)


@gluon.jit
def mma_gemv_kernel(X, W, S, Y, PARTS, ARRIVALS, N, KW, G, GPS: gl.constexpr, NW: gl.constexpr,
                    SPLIT: gl.constexpr, HOIST: gl.constexpr):
    """Y = W·X for 4-bit W [N, KW words] (groups of 128, symmetric, scales S [N, G]); a program is
    16·NW rows by GPS groups (split ``program_id(1)``). ``HOIST``: the first group's words are made
    to depend on every group's (an or of them all, anded with ``N >> 31``: zero, but not to the
    compiler), so that every load is issued before the first group's arithmetic and the thread
    waits once for all its bytes."""
    BN: gl.constexpr = 16 * NW
    MMA: gl.constexpr = _mma_layout(NW)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    WL: gl.constexpr = _word_layout(NW)
    tile = gl.program_id(0)
    split = gl.program_id(1)
    g0 = split * GPS
    wr = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
    wc = gl.arange(0, 16, layout=gl.SliceLayout(0, WL))
    words_at = W + wr[:, None].to(gl.int64) * KW + (g0 * 16 + wc)[None, :]
    xc = gl.arange(0, 128, layout=_x_layout(NW))
    sr = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    ws = ()
    for i in gl.static_range(GPS):  # every group's words asked for before any is used
        ws = ws + (gl.load(words_at + i * 16),)
    if HOIST:
        every = ws[0]
        for i in gl.static_range(1, GPS):
            every = every | ws[i]
        ws = (ws[0] + (every & (N >> 31)),) + ws[1:]
    acc = gl.zeros([BN, 8], gl.float32, MMA)
    bias = gl.full([BN, 128], -136.0, gl.bfloat16, A)
    for i in gl.static_range(GPS):
        b = _b_operand(gl.load(X + (g0 + i) * 128 + xc), B)
        s = gl.load(S + sr * G + g0 + i).to(gl.float32)
        d = mma_v2(bias, b, mma_v2(_a_operand(ws[i], A, BN), b, gl.zeros([BN, 8], gl.float32, MMA)))
        acc += s[:, None] * d
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    y = gl.sum(gl.where(n[None, :] == 0, acc, 0.0), axis=1)  # the 8 columns hold the same sums
    if SPLIT == 1:
        gl.store(Y + sr, y.to(gl.bfloat16))
    else:
        gl.store(PARTS + split * N + sr, y)
        gl.thread_barrier()
        if gl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = gl.zeros_like(y)
            for j in gl.static_range(SPLIT):
                total += gl.load(PARTS + j * N + sr, cache_modifier=".cg")
            gl.store(Y + sr, total.to(gl.bfloat16))
            gl.atomic_xchg(ARRIVALS + tile, 0)


def mma_gemv(x, w: PackedMatrix, nw: int, split: int, hoist: bool, workspace: launching.SplitWorkspace,
             warmup=False):
    n, k = w.shape
    groups = k // GS
    assert n % (16 * nw) == 0 and groups % split == 0, (n, k, nw, split)
    y = torch.empty(1, n, dtype=torch.bfloat16, device=x.device)
    tiles = n // (16 * nw)
    parts, arrivals = workspace.take(split * n, tiles) if split > 1 else (y, y)
    args = (x, w.codes, w.scales, y, parts, arrivals, n, k // 8, groups)
    meta = dict(GPS=groups // split, NW=nw, SPLIT=split, HOIST=hoist, num_warps=nw)
    if warmup:
        mma_gemv_kernel.warmup(*args, grid=(tiles, split), **meta)
        return None
    mma_gemv_kernel[(tiles, split)](*args, **meta)
    return y


def error(got, want):
    return float((got.float() - want).abs().max() / want.abs().max())


def product(name):
    n, k, splits = PRODUCTS[name]
    torch.manual_seed(0)
    ws = [random_packed(n, k, 4, GS, DEV) for _ in range(LAYERS)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    want = x.float() @ kernels.dequantize_with_torch(ws[0].codes, ws[0].scales, None, ws[0].layout,
                                                      torch.bfloat16).float().T
    space = launching.SplitWorkspace(DEV)
    ours = [(nw, s, h) for nw in WARPS for s in splits for h in (False, True) if n % (16 * nw) == 0]
    warm = [lambda c=c: td.packed_gemv(x, ws[0], c, workspace=space, warmup=True) for c in td.PACKED_GEMV_CANDIDATES]
    warm += [lambda nw=nw, s=s, h=h: mma_gemv(x, ws[0], nw, s, h, space, warmup=True) for nw, s, h in ours]
    t0 = time.time()
    kernels.compile_ahead(warm)
    row = {"n": n, "k": k, "mb_a_layer": ws[0].nbytes / 1e6, "compile_s": round(time.time() - t0, 1),
           "packed_gemv": {}, "mma": {}}
    for c in td.PACKED_GEMV_CANDIDATES:
        key = f"{c.bn}x{c.bk}/{c.warps}w split {c.split}" + (f" r{c.registers}" if c.registers else "")
        try:
            err = error(td.packed_gemv(x, ws[0], c, workspace=space), want)
            us = kernels.graph_time_us([lambda w=w, c=c: td.packed_gemv(x, w, c, workspace=space) for w in ws], 10)
            row["packed_gemv"][key] = {"us": round(us, 2), "err": err}
        except Exception as e:  # noqa: BLE001 - a tile that fails is recorded, the others go on
            row["packed_gemv"][key] = {"error": repr(e)[:300]}
    for nw, s, h in ours:
        key = f"{16 * nw} rows/{nw}w split {s}" + (" hoisted" if h else "")
        try:
            err = error(mma_gemv(x, ws[0], nw, s, h, space), want)
            us = kernels.graph_time_us([lambda w=w, nw=nw, s=s, h=h: mma_gemv(x, w, nw, s, h, space) for w in ws], 10)
            row["mma"][key] = {"us": round(us, 2), "err": err}
        except Exception as e:  # noqa: BLE001
            row["mma"][key] = {"error": repr(e)[:300]}
    for kind in ("packed_gemv", "mma"):
        timed = {k2: v for k2, v in row[kind].items() if "us" in v}
        best = min(timed, key=lambda k2: timed[k2]["us"]) if timed else None
        row[f"best_{kind}"] = [best, timed[best]["us"] if best else None]
    row["gb_s_best_mma"] = round(ws[0].nbytes / (row["best_mma"][1] or float("inf")) / 1e3, 1)
    return row


def run_products(product, names, filename: str, shown: tuple[str, ...]):
    """``product(name)`` for each of ``names``, its ``shown`` keys printed as it ends, and every row so
    far written to ``$OUT/filename`` after each (with the torch, Triton and GPU, and the load
    average before and after); a product that fails is recorded with its traceback."""
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "loadavg_before": os.getloadavg()}
    for name in names:
        try:
            res[name] = product(name)
            print(name, json.dumps({k: v for k, v in res[name].items() if k.startswith(shown)}), flush=True)
        except Exception:  # noqa: BLE001
            res[name] = {"error": traceback.format_exc()[-3000:]}
            print(name, res[name]["error"], flush=True)
        res["loadavg_after"] = os.getloadavg()
        with open(os.path.join(OUT, filename), "w") as f:
            json.dump(res, f, indent=1)


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(PRODUCTS)
    run_products(product, names, "probe-mma-gemv.json", ("best", "gb", "comp"))


if __name__ == "__main__":
    main()
