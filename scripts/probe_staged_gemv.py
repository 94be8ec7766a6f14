"""Diagnostic probe (not a benchmark): the batch-1 4-bit product with a program's whole share of
the weight copied into shared memory at once, then multiplied group by group as it lands, beside
the decode step's ``packed_gemv`` and the tensor-core probe that holds its words in registers.

    OUT=folder python scripts/probe_staged_gemv.py [gate_up,down,qkv,o]    # on a GPU
    python scripts/probe_staged_gemv.py --sass                             # no GPU: the sm_90 binaries

Why: under Nsight Compute the batch-1 products were bound neither by bytes (gate|up at 23% of
DRAM's peak) nor by issue (41% of issue slots) (docs/results/probes/h200-ncu-products). The
whole grid is resident at once, so each SM's programs ask for a step's words, wait, multiply,
and ask again together: a product of S steps waits S memory latencies, and the memory is busy
only while they wait. Holding more steps' words in registers did not help (``HOIST`` of
``probe_mma_gemv.py``: every load out first, then one wait for all, then all the arithmetic), and
Triton's own pipeline copied 4 bytes at a time with a barrier a step
(docs/results/probes/h200-pipelined-gemv).

Here (Gluon) a program issues every 16-byte ``cp.async`` of its share of the words first, a
commit group per group of 128 columns, with its x and its scales in the first; no register holds
them in flight, so the copies of a whole wave are out at once, as many bytes as shared memory
holds. Then group i waits only for the copies up to its own (``cp.async.wait_group``), so it
multiplies while the later groups are still arriving: the memory streams and the arithmetic
follows it, rather than the two taking turns. The arithmetic is ``probe_mma_gemv.py``'s (a word's
codes as bf16 128 + q pairs in the A operand's registers, ``mma.sync`` m16n8k16, a second MMA
taking off 136 a code), so the two probes differ only in where the words wait.

A program is 16·NW rows by GPS groups (K split ``split`` ways, the last split to arrive adds the
partials in split order). The scales are read from a ``[groups, N]`` copy (a group's scales of
a tile side by side, for 16-byte copies): the probe makes that copy, a layout a packed weight
could keep. Weights are random codes with bf16 scales, groups of 128, symmetric, 28 copies of
each product (one per layer, so reads come from memory as in a step); every kernel is a plain
product (no prologue or epilogue, bf16 out), timed from one CUDA graph per tile
(``kernels.graph_time_us``), every tile of the three kernels in one process. Each output is
checked against the product with the weight dequantized to bf16 (float32 sums): largest
difference over the largest output. Writes ``$OUT/probe-staged-gemv.json``.

``--sass`` compiles the staged kernel for sm_90 (and sm_87: Ampere's ``cp.async``, no TMA, so
Orin runs it too) as a launch specializes it, and prints per tile its registers, shared memory,
16-byte copies, waits and barriers: the structure above, read from the binary.
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
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from probe_mma_gemv import _a_operand, _b_operand, _mma_layout, _word_layout, _x_layout, mma_gemv

OUT = os.environ.get("OUT", "/tmp")
LAYERS, GS = 28, 128
# N, K, (warps, splits) tried: a tile's shared memory is its share of the words (16·warps rows by
# K / split columns) plus its x and scales, and every program of the grid should fit at once
PRODUCTS = {"gate_up": (17920, 1536, ((1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (4, 1), (4, 2), (4, 3))),
            "down": (1536, 8960, ((1, 5), (1, 7), (1, 10), (1, 14), (2, 7), (2, 10), (4, 10), (4, 14), (4, 35))),
            "qkv": (2048, 1536, ((1, 2), (1, 3), (1, 4), (1, 6), (4, 4), (4, 6))),
            "o": (1536, 1536, ((1, 2), (1, 3), (1, 4), (1, 6), (4, 4), (4, 6)))}

# a CTA's barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` in 3.9; a copy into shared memory:
# ``async_copy_global_to_shared`` in 3.6, ``async_load`` in 3.9 (as edgeinfer.quant.tensor_core)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.constexpr_function
def _plain(rank):
    """Shared memory as the values lie, row after row (a lane's 16 bytes are its own; no swizzle), for
    views of ``rank`` dimensions (a buffer of rank + 1 is indexed along its first)."""
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=list(range(rank - 1, -1, -1)))


@gluon.jit
def staged_gemv_kernel(X, W, ST, Y, PARTS, ARRIVALS, N, KW, GPS: gl.constexpr, XP: gl.constexpr,
                       NW: gl.constexpr, SPLIT: gl.constexpr, STREAM: gl.constexpr):
    """Y = W·X for 4-bit W [N, KW words] (groups of 128, symmetric; scales ``ST`` [groups, N]); a
    program is 16·NW rows by GPS groups (split ``program_id(1)``); ``XP`` is GPS rounded up to a
    power of two (x's and the scales' buffers are [XP, ·], a group a row). ``STREAM``: group i waits
    for the copies up to its own; else the first waits for all (every byte in flight at once, as
    before, but the arithmetic after the last byte, as ``probe_mma_gemv.py``'s ``HOIST``)."""
    BN: gl.constexpr = 16 * NW
    MMA: gl.constexpr = _mma_layout(NW)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    WL: gl.constexpr = _word_layout(NW)
    VL: gl.constexpr = gl.BlockedLayout(size_per_thread=[8], threads_per_warp=[32], warps_per_cta=[NW], order=[0])
    tile = gl.program_id(0)
    split = gl.program_id(1)
    g0 = split * GPS
    # a buffer a group (shared memory's shapes are powers of two; GPS need not be) and a commit group a
    # group: its words, its 128 columns of x and its scales of the tile's rows (16-byte copies; lanes
    # past x's 256 bytes or the scales' 2·BN copy the same bytes again)
    wr = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
    wc = gl.arange(0, 16, layout=gl.SliceLayout(0, WL))
    words_at = W + wr[:, None].to(gl.int64) * KW + (g0 * 16 + wc)[None, :]
    x_at = X + g0 * 128 + gl.arange(0, 128, layout=VL)
    s_at = ST + g0 * N + tile * BN + gl.arange(0, BN, layout=VL)
    w_smem = ()
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [XP, 128], _plain(1))
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [XP, BN], _plain(1))
    for i in gl.static_range(GPS):
        w_smem = w_smem + (gl.allocate_shared_memory(gl.int32, [BN, 16], _plain(2)),)
        _async_load(w_smem[i], words_at + i * 16)
        _async_load(x_smem.index(i), x_at + i * 128)
        _async_load(s_smem.index(i), s_at + i * N)
        async_copy.commit_group()
    acc = gl.zeros([BN, 8], gl.float32, MMA)
    bias = gl.full([BN, 128], -136.0, gl.bfloat16, A)
    for i in gl.static_range(GPS):
        if STREAM:
            async_copy.wait_group(GPS - 1 - i)  # this thread's copies up to group i have landed
            _cta_barrier()  # and every other thread's: x and the scales are read by other lanes than copied them
        elif i == 0:
            async_copy.wait_group(0)
            _cta_barrier()
        b = _b_operand(x_smem.index(i).load(_x_layout(NW)), B)
        s = s_smem.index(i).load(gl.SliceLayout(1, MMA)).to(gl.float32)
        words = w_smem[i].load(WL)
        d = mma_v2(bias, b, mma_v2(_a_operand(words, A, BN), b, gl.zeros([BN, 8], gl.float32, MMA)))
        acc += s[:, None] * d
    sr_o = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    y = gl.sum(gl.where(n[None, :] == 0, acc, 0.0), axis=1)  # the 8 columns hold the same sums
    if SPLIT == 1:
        gl.store(Y + sr_o, y.to(gl.bfloat16))
    else:
        gl.store(PARTS + split * N + sr_o, y)
        _cta_barrier()
        if gl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = gl.zeros_like(y)
            for j in gl.static_range(SPLIT):
                total += gl.load(PARTS + j * N + sr_o, cache_modifier=".cg")
            gl.store(Y + sr_o, total.to(gl.bfloat16))
            gl.atomic_xchg(ARRIVALS + tile, 0)


def shape(n: int, k: int, nw: int, split: int, stream: bool = True) -> dict:
    """The staged kernel's constexprs for an [n, k] product on ``nw`` warps split ``split`` ways."""
    groups = k // GS
    if n % (16 * nw) or groups % split:
        raise ValueError(f"{n}x{k}: tiles of {16 * nw} rows and {split} splits of {groups} groups do not fit")
    gps = groups // split
    return dict(GPS=gps, XP=triton.next_power_of_2(gps), NW=nw, SPLIT=split, STREAM=stream, num_warps=nw)


def shared_bytes(n: int, k: int, nw: int, split: int) -> int:
    """A program's shared memory: its words, its x and its scales (the last two rounded up to XP rows)."""
    meta = shape(n, k, nw, split)
    return meta["GPS"] * 16 * nw * 64 + meta["XP"] * (128 + 16 * nw) * 2


def staged_gemv(x, w, scales_t, nw: int, split: int, stream: bool, workspace, warmup=False):
    n, k = w.shape
    meta = shape(n, k, nw, split, stream)
    y = torch.empty(1, n, dtype=torch.bfloat16, device=x.device)
    tiles = n // (16 * nw)
    parts, arrivals = workspace.take(split * n, tiles) if split > 1 else (y, y)
    args = (x, w.codes, scales_t, y, parts, arrivals, n, k // 8)
    if warmup:
        staged_gemv_kernel.warmup(*args, grid=(tiles, split), **meta)
        return None
    staged_gemv_kernel[(tiles, split)](*args, **meta)
    return y


def error(got, want):
    return float((got.float() - want).abs().max() / want.abs().max())


def product(name):
    from edgeinfer.backends.torch import triton_decode as td
    from edgeinfer.quant import kernels
    from edgeinfer.testing.products import random_packed

    dev = torch.device("cuda")
    n, k, tiles = PRODUCTS[name]
    torch.manual_seed(0)
    ws = [random_packed(n, k, 4, GS, dev) for _ in range(LAYERS)]
    st = [w.scales.t().contiguous() for w in ws]
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    want = x.float() @ kernels.dequantize_with_torch(ws[0].codes, ws[0].scales, None, ws[0].layout,
                                                      torch.bfloat16).float().T
    space = kernels.SplitWorkspace(dev)
    regs_splits = sorted({s for _, s in tiles})
    theirs = [(nw, s) for nw in (1, 4) for s in regs_splits if n % (16 * nw) == 0 and (k // GS) % s == 0]
    warm = [lambda c=c: td.packed_gemv(x, ws[0], c, workspace=space, warmup=True) for c in td.PACKED_GEMV_CANDIDATES]
    warm += [lambda nw=nw, s=s: mma_gemv(x, ws[0], nw, s, False, space, warmup=True) for nw, s in theirs]
    warm += [lambda nw=nw, s=s, f=f: staged_gemv(x, ws[0], st[0], nw, s, f, space, warmup=True)
             for nw, s in tiles for f in (True, False)]
    t0 = time.time()
    kernels.compile_ahead(warm)
    row = {"n": n, "k": k, "mb_a_layer": ws[0].nbytes / 1e6, "compile_s": round(time.time() - t0, 1),
           "packed_gemv": {}, "mma_registers": {}, "staged": {}}
    runs = [("packed_gemv", f"{c.bn}x{c.bk}/{c.warps}w split {c.split}" + (f" r{c.registers}" if c.registers else ""),
             lambda w, i, c=c: td.packed_gemv(x, w, c, workspace=space)) for c in td.PACKED_GEMV_CANDIDATES]
    runs += [("mma_registers", f"{16 * nw} rows/{nw}w split {s}",
              lambda w, i, nw=nw, s=s: mma_gemv(x, w, nw, s, False, space)) for nw, s in theirs]
    runs += [("staged", f"{16 * nw} rows/{nw}w split {s}" + ("" if f else " one wait"),
              lambda w, i, nw=nw, s=s, f=f: staged_gemv(x, w, st[i], nw, s, f, space))
             for nw, s in tiles for f in (True, False)]
    for kind, key, run in runs:
        try:
            err = error(run(ws[0], 0), want)
            us = kernels.graph_time_us([lambda i=i, w=w, run=run: run(w, i) for i, w in enumerate(ws)], 10)
            row[kind][key] = {"us": round(us, 2), "err": err}
        except Exception as e:  # noqa: BLE001 - a tile that fails is recorded, the others go on
            row[kind][key] = {"error": repr(e)[:300]}
    for kind in ("packed_gemv", "mma_registers", "staged"):
        timed = {k2: v for k2, v in row[kind].items() if "us" in v}
        best = min(timed, key=lambda k2: timed[k2]["us"]) if timed else None
        row[f"best_{kind}"] = [best, timed[best]["us"] if best else None]
        row[f"gb_s_best_{kind}"] = round(ws[0].nbytes / (row[f"best_{kind}"][1] or float("inf")) / 1e3, 1)
    return row


def sass_report():
    """Per product and tile, the staged kernel compiled for sm_90 and sm_87 as a launch specializes it."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from edgeinfer.testing.triton_compile import disassembled, instructions, opcodes, resources

    fn = staged_gemv_kernel
    names = fn.arg_names
    types = {"X": "*bf16", "W": "*i32", "ST": "*bf16", "Y": "*bf16", "PARTS": "*fp32", "ARRIVALS": "*i32",
             "N": "i32", "KW": "i32"}
    aligned = ("X", "W", "ST", "Y", "PARTS", "ARRIVALS", "N", "KW")
    print(f"triton {triton.__version__}; 4-bit, bf16 scales, groups of 128, symmetric")
    for arch in (90, 87):
        for name, (n, k, tiles) in PRODUCTS.items():
            for nw, split in tiles:
                meta = shape(n, k, nw, split)
                given = {key: v for key, v in meta.items() if key != "num_warps"}
                source = GluonASTSource(fn, {a: types.get(a, "constexpr") for a in names},
                                        {(names.index(a),): v for a, v in given.items()},
                                        {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
                kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": nw})
                binary = kernel.asm["cubin"]
                ops = opcodes(instructions(disassembled(binary)), modifiers=True)
                copies = {op: c for op, c in ops.items() if op.startswith("LDGSTS")}
                waits = sum(c for op, c in ops.items() if op.startswith(("DEPBAR", "LDGDEPBAR")))
                regs = resources(binary)
                print(f"sm_{arch} {name} {n}x{k}, {16 * nw} rows/{nw}w split {split} ({meta['GPS']} groups a program): "
                      f"{regs.get('REG')} registers, {regs.get('STACK')} bytes spilled, {kernel.metadata.shared} "
                      f"bytes shared (counted {shared_bytes(n, k, nw, split)}); copies "
                      + ", ".join(f"{op} {c}" for op, c in sorted(copies.items()))
                      + f"; commit/wait {waits}; BAR {sum(c for op, c in ops.items() if op.startswith('BAR'))}; "
                      f"HMMA {sum(c for op, c in ops.items() if op.startswith('HMMA'))}; "
                      f"LDG {sum(c for op, c in ops.items() if op.startswith('LDG.'))}")


def main():
    if "--sass" in sys.argv:
        sass_report()
        return
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(PRODUCTS)
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "loadavg_before": os.getloadavg()}
    for name in names:
        try:
            res[name] = product(name)
            print(name, json.dumps({k: v for k, v in res[name].items() if k.startswith(("best", "gb", "comp"))}),
                  flush=True)
        except Exception:  # noqa: BLE001
            res[name] = {"error": traceback.format_exc()[-3000:]}
            print(name, res[name]["error"], flush=True)
        res["loadavg_after"] = os.getloadavg()
        with open(os.path.join(OUT, "probe-staged-gemv.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
