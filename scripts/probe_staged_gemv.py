"""Diagnostic probe (not a benchmark): the batch-1 4-bit product with a program's words waiting in
shared memory (``edgeinfer.quant.staged``), beside the decode step's ``packed_gemv`` and the
tensor-core probe that holds its words in registers (``probe_mma_gemv.py``), on a GPU.

    OUT=folder python scripts/probe_staged_gemv.py [gate_up,down,qkv,o]    # on a GPU
    python scripts/probe_staged_gemv.py --sass                             # no GPU: the binaries

Why (``edgeinfer.quant.staged``'s docstring): the batch-1 products were bound neither by bytes nor
by issue; each SM's programs ask for a step's words, wait and multiply together, so a product of
S steps waits S memory latencies. The staged kernel issues every 16-byte ``cp.async`` of a
program's share of the words first and multiplies chunk i once the copies up to its own have
landed, while the later ones still arrive. Its arithmetic is the tensor-core probe's.

Each product of a Qwen2-VL-2B layer, 4-bit with bf16 scales in groups of 128, symmetric, 28 copies
(one per layer, so reads come from memory as in a step), timed two ways, every tile in one
process, from one CUDA graph per tile (``kernels.graph_time_us``):

- ``fused``: as the decode step calls it (q|k|v with RMSNorm and bias, o and ``down`` with the
  residual, gate|up with RMSNorm and SiLU·up): every ``packed_gemv`` tile against every staged
  tile that fits (``staged.unfit``), each staged tile also with half its chunks' copies issued
  before x is read and the rest after (``/early``), each first checked as the tuner checks it
  (``triton_decode.right_tiles``: torch's product at the outputs ``kernels.checked_outputs``
  names, within ``kernels.divergence``'s bounds); a tile outside them is named and not timed.
- ``plain``: no prologue or epilogue, the staged tiles against the tensor-core probe's
  (``probe_mma_gemv.mma_gemv``, words in registers, the same arithmetic): where the words wait is
  then the only difference. Each output's largest difference from the dequantized product over
  the largest output is recorded.

Writes ``$OUT/probe-staged-gemv.json`` (load averages before and after). ``--sass`` compiles the
staged kernel for sm_90 and sm_87 as a launch specializes it, the step's fusions included, and
prints per tile its registers, spills, shared memory, copies, waits and whether every copy goes
out before the first wait.
"""
import sys
import time

import torch
import triton

from edgeinfer.quant import staged
from edgeinfer.quant.launching import SplitWorkspace, pow2

LAYERS, GS = 28, 128
PRODUCTS = {"gate_up": (17920, 1536, "norm+glu"), "down": (1536, 8960, "residual"),
            "qkv": (2048, 1536, "norm+bias"), "o": (1536, 1536, "residual")}  # N, K, what the step fuses
MMA_TILES = {"gate_up": ((1, 2), (4, 3)), "down": ((1, 14), (4, 35)), "qkv": ((1, 6), (4, 6)),
             "o": ((1, 6), (4, 6))}  # (warps, split): probe_mma_gemv's fastest on the H100


def staged_tiles(w, glu: bool) -> list:
    """Every staged tile that fits ``w`` with at least two chunks a program (more than the tuner's)."""
    chunks = w.shape[1] // staged.CHUNK
    return [staged.StagedGemvConfig(nw, s) for nw in staged.WARPS for s in range(1, chunks // 2 + 1)
            if chunks % s == 0 and staged.unfit(w, torch.bfloat16, glu, staged.StagedGemvConfig(nw, s)) is None]


def name(c) -> str:
    from edgeinfer.backends.torch import triton_decode as td

    return td._config_name(c)


def product(which):
    from edgeinfer.backends.torch import triton_decode as td
    from edgeinfer.quant import kernels
    from edgeinfer.testing.products import fused_inputs, random_packed
    from probe_mma_gemv import mma_gemv

    dev = torch.device("cuda")
    n, k, kind = PRODUCTS[which]
    torch.manual_seed(0)
    ws = [random_packed(n, k, 4, GS, dev) for _ in range(LAYERS)]
    x, kw = fused_inputs(kind, n, k, dev)
    glu = kw.get("glu", False)
    space = SplitWorkspace(dev)
    ours = staged_tiles(ws[0], glu)
    # each also with half its chunks copied before x is read and the rest after (``early``): whether x,
    # written by the kernel before, waits behind a whole program's copies
    ours += [staged.StagedGemvConfig(c.warps, c.split, max(1, k // staged.CHUNK // c.split // 2)) for c in ours]
    plain_ours = staged_tiles(ws[0], False)
    theirs = list(td.PACKED_GEMV_CANDIDATES)
    outs = [torch.empty(1, n // 2 if glu else n, dtype=x.dtype, device=dev) for _ in ws]

    def fused(w, c, out, warmup=False):  # as the decode step dispatches a tile
        return td.one_row_product(x, w, c, out=out, workspace=space, warmup=warmup, **kw)

    warm = [lambda c=c: fused(ws[0], c, outs[0], True) for c in theirs + ours]
    warm += [lambda c=c: staged.staged_gemv(x, ws[0], c, workspace=space, warmup=True) for c in plain_ours]
    warm += [lambda t=t: mma_gemv(x, ws[0], *t, False, space, warmup=True) for t in MMA_TILES[which]]
    t0 = time.time()
    kernels.compile_ahead(warm)
    row = {"n": n, "k": k, "fuses": kind, "mb_a_layer": ws[0].nbytes / 1e6, "compile_s": round(time.time() - t0, 1),
           "fused": {}, "plain": {}}
    right, wrong = td.right_tiles(x, ws[0], theirs + ours, outs[0], lambda _x, w, c, out, **_kw: fused(w, c, out), **kw)
    row["fused_wrong"] = wrong
    for c in theirs + ours:
        if c not in right:
            continue
        try:
            us = kernels.graph_time_us([lambda w=w, o=o, c=c: fused(w, c, o) for w, o in zip(ws, outs)], 10)
            row["fused"][name(c)] = round(us, 2)
        except Exception as e:  # noqa: BLE001 - a tile that fails is recorded, the others go on
            row["fused"][name(c)] = repr(e)[:300]
    want = x.float() @ kernels.dequantize_with_torch(ws[0].codes, ws[0].scales, None, ws[0].layout,
                                                      torch.bfloat16).float().T
    plain = [(f"staged/{c.warps}w/split{c.split}", lambda w, c=c: staged.staged_gemv(x, w, c, workspace=space))
             for c in plain_ours]
    plain += [(f"mma-registers/{t[0]}w/split{t[1]}", lambda w, t=t: mma_gemv(x, w, *t, False, space))
              for t in MMA_TILES[which]]
    for key, run in plain:
        try:
            err = float((run(ws[0]).float() - want).abs().max() / want.abs().max())
            us = kernels.graph_time_us([lambda w=w, run=run: run(w) for w in ws], 10)
            row["plain"][key] = {"us": round(us, 2), "err": err}
        except Exception as e:  # noqa: BLE001
            row["plain"][key] = {"error": repr(e)[:300]}
    for part, prefixes in (("fused", ("staged", "")), ("plain", ("staged", "mma-registers"))):
        for prefix in prefixes:
            timed = {t: (v if part == "fused" else v.get("us")) for t, v in row[part].items()
                     if (t.startswith(prefix) if prefix else not t.startswith("staged"))}
            timed = {t: v for t, v in timed.items() if isinstance(v, float)}
            best = min(timed, key=timed.get) if timed else None
            row[f"best_{part}_{prefix or 'packed_gemv'}"] = [best, timed.get(best)]
    return row


def sass_report():
    """Per product and tile, the staged kernel compiled for sm_90 and sm_87 as the step launches it."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from edgeinfer.testing.triton_compile import disassembled, instructions, opcodes, resources

    fn = staged._staged_gemv_kernel
    names = fn.arg_names
    types = {**{a: "*bf16" for a in ("X", "S", "Z", "BIAS", "RES", "NORM_W", "Y")}, "W": "*i32",
             "PARTS": "*fp32", "ARRIVALS": "*i32", **dict.fromkeys(("N", "K", "KW", "G", "M"), "i32"), "eps": "fp32"}
    aligned = ("X", "W", "S", "Z", "BIAS", "RES", "NORM_W", "Y", "PARTS", "ARRIVALS", "N", "K", "KW")
    print(f"triton {triton.__version__}; 4-bit, bf16, groups of 128, symmetric; fused as the decode step calls "
          "each product")
    for arch in (90, 87):
        for which, (n, k, kind) in PRODUCTS.items():
            glu = "glu" in kind
            for nw in staged.WARPS:
                for split in range(1, k // staged.CHUNK // 2 + 1):
                    chunks = k // staged.CHUNK
                    if chunks % split or (n if not glu else n // 2) % (16 * nw if not glu else 8 * nw) \
                            or chunks // split > staged.MAX_CHUNKS \
                            or staged.shared_bytes(k, nw, split) > staged.MAX_SHARED:
                        continue
                    gps = chunks // split
                    given = dict(GPS=gps, NW=nw, SPLIT=split, EARLY=gps, GS=GS, XB=min(pow2(k), 2048),
                                 PROLOGUE="norm" in kind, HAS_BIAS="bias" in kind, HAS_RES="residual" in kind,
                                 HAS_Z=False, GLU=glu, BF16=True, PDL=arch >= 90, M=1, MP=1)
                    source = GluonASTSource(fn, {a: types.get(a, "constexpr") for a in names},
                                            {(names.index(a),): v for a, v in given.items()},
                                            {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
                    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                            options={"num_warps": nw, "launch_pdl": arch >= 90})
                    binary = kernel.asm["cubin"]
                    ins = instructions(disassembled(binary))
                    ops = opcodes(ins, modifiers=True)
                    copies = [i for i, op in enumerate(ins) if "LDGSTS" in op]
                    waits = [i for i, op in enumerate(ins) if "DEPBAR.LE" in op]
                    regs = resources(binary)
                    widths = ", ".join(f"{op} {c}" for op, c in sorted(ops.items()) if op.startswith("LDGSTS"))
                    print(f"sm_{arch} {which} {n}x{k} ({kind}), staged/{nw}w/split{split} ({gps} chunks a program): "
                          f"{len(ins)} instructions, {regs.get('REG')} registers, {regs.get('STACK')} bytes spilled, "
                          f"{kernel.metadata.shared} bytes shared; copies {widths}; waits {len(waits)}; "
                          f"every copy before the first wait: {bool(copies) and max(copies) < min(waits)}; "
                          f"HMMA {sum(c for op, c in ops.items() if op.startswith('HMMA'))}")


def main():
    if "--sass" in sys.argv:
        sass_report()
        return
    from probe_mma_gemv import run_products

    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(PRODUCTS)
    run_products(product, names, "probe-staged-gemv.json", ("best", "comp", "fused_w"))


if __name__ == "__main__":
    main()
