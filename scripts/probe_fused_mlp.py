"""Diagnostic probe (not a benchmark): a 4-bit layer's MLP at batch 1 as one kernel, beside the two
products the decode step runs for it (gate|up with RMSNorm and SiLU·up, then ``down`` with the
residual), on a GPU.

    OUT=folder python scripts/probe_fused_mlp.py            # on a GPU: check, then time
    TRITON_INTERPRET=1 python scripts/probe_fused_mlp.py --check   # no GPU: the kernel's outputs
    python scripts/probe_fused_mlp.py --sass                       # no GPU: each tile for sm_90 and sm_87

Why. At batch 1 gate|up and ``down`` take about half of a 4-bit step (16 µs of a layer's 30 on an
H200) and stream 1.3 TB/s: neither is bound by its bytes. Each is a short kernel whose programs
fit in about one wave and wait a memory round trip a K step, and ``down`` cannot start its
products before gate|up's last program has written the activation. Split along the intermediate
dimension instead, the MLP needs no such wait: a program takes CI of the intermediate columns,
reads their gate and up rows and the same CI columns of ``down``, finishes SiLU(gate)·up for its
columns itself and adds ``down``'s share of them to every output. So one kernel reads all of the
MLP's words, the ``down`` words from its start, with no boundary between the two products.

The programs' shares of the outputs are summed in 64-bit integers (the float32 share times 2^32,
rounded toward zero), whose additions give the same total in any order, so the output does not
depend on which program arrives first, as the split products' partials do not; the last program
to arrive converts the totals, rounds them as the eager layer rounds ``down``'s product, adds the
residual, writes the row, and sets the totals and its count back to zero.

Each variant is timed over 28 copies of the weights (one per layer, so reads come from memory as
in a step) from one CUDA graph, the pair with the fastest alone of every tile the step's tuner
times for each product (``packed_gemv``'s and the staged kernel's), both ways in turns,
``ROUNDS`` times; medians. Before it is timed, every fused tile's row is checked against torch's
(the dequantized weights, rounded where the eager layer rounds) within the tuner's bounds
(``kernels.divergence``). Writes ``$OUT/probe-fused-mlp.json`` (load averages before and after).
"""
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels
from edgeinfer.quant.kernels import (
    arrived_last,
    await_inputs,
    biased_codes_at,
    code_exponent,
)
from edgeinfer.quant.launching import SplitWorkspace, interpreting, launch_options, pow2
from edgeinfer.testing.products import check_or_run

LAYERS, GS, HIDDEN, INTER = 28, 128, 1536, 8960  # Qwen2-VL-2B's MLP
FIXED = 2.0 ** 32  # a share's units in the 64-bit totals
# (CI intermediate columns a program, BK columns a gate|up step, HB outputs a down block, warps)
TILES = [(8, 512, 512, 4), (8, 256, 512, 4), (8, 512, 256, 4), (16, 512, 512, 4), (16, 512, 512, 8),
         (16, 256, 512, 4), (16, 512, 256, 4), (16, 256, 256, 8), (32, 512, 512, 8), (32, 256, 256, 4)]
HOWS = {0: "int64", 1: "float32 atomics", 2: "unsummed"}  # how the programs' shares are summed (``fused_mlp``)


@triton.jit
def _fused_mlp_kernel(X, NORM_W, GU, S_GU, Z_GU, D, S_D, Z_D, Y, TOTALS, ARRIVALS, H, I, G_GU, G_D, eps,
                      CI: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr, XB: tl.constexpr, GS: tl.constexpr,
                      HAS_Z: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, SUM: tl.constexpr = 0,
                      SHARES=None):
    """Y = X + down(SiLU(gate(n(X)))·up(n(X))) for one row X [H] (n: RMSNorm with NORM_W), 4-bit
    gate|up ``GU`` [2I, H/8] (gate rows, then up rows) and ``down`` ``D`` [H, I/8], groups of GS
    columns (a power of two, at least CI and BK, a multiple of CI). Program p takes intermediate
    columns [p·CI, (p+1)·CI): their 2·CI gate|up rows, BK columns a step, then those columns of
    every ``down`` row, HB rows a block, and adds its share to ``TOTALS`` (int64 [H], zero)."""
    PER: tl.constexpr = 8
    dt = Y.dtype.element_ty
    c0 = tl.program_id(0) * CI
    BN: tl.constexpr = 2 * CI
    r = tl.arange(0, BN)
    rows = c0 + r % CI + (r // CI) * I  # gate rows, then the up rows of the same columns
    BKW: tl.constexpr = BK // PER
    NG: tl.constexpr = BK // GS if BK >= GS else 1
    rw = tl.arange(0, BKW)
    words_at = GU + rows[:, None].to(tl.int64) * (H // PER) + rw[None, :]
    words = tl.load(words_at)
    s_rows = S_GU + rows[:, None] * G_GU + tl.arange(0, NG)[None, :]
    z_rows = Z_GU + rows[:, None] * G_GU + tl.arange(0, NG)[None, :]
    s = tl.load(s_rows).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_rows).to(tl.float32)
    else:
        z = tl.full([BN, NG], 8.0, tl.float32)
    # down: this program's CI columns of every output row, a block of HB rows ahead
    DW: tl.constexpr = CI // PER
    rh = tl.arange(0, HB)
    d_at = D + rh[:, None].to(tl.int64) * (I // PER) + (c0 // PER + tl.arange(0, DW))[None, :]
    d_words = tl.load(d_at)
    g_d = c0 // GS
    d_s = tl.load(S_D + rh * G_D + g_d).to(tl.float32)
    if HAS_Z:
        d_z = tl.load(Z_D + rh * G_D + g_d).to(tl.float32)
    else:
        d_z = tl.full([HB], 8.0, tl.float32)
    await_inputs(PDL)
    rk = tl.arange(0, XB)
    xv = tl.load(X + rk, mask=rk < H, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / H + eps)
    wide = tl.zeros([BN, BKW], tl.float32)
    stepped = 0
    for k0 in range(0, H, BK):
        first = k0 + rw * PER
        this_words, this_s, this_z = words, s, z
        ahead = tl.where(k0 + BK < H, BK, 0)  # the last step reads its own words again
        stepped += ahead // PER
        words = tl.load(words_at + stepped)
        s = tl.load(s_rows + (k0 + ahead) // GS).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_rows + (k0 + ahead) // GS).to(tl.float32)
        xsum = tl.zeros([BKW], tl.float32)
        xbias = tl.zeros([BKW], tl.float32)
        for i in tl.static_range(PER):
            xi = td._input_values(X, NORM_W, first + i, H, rstd, 1, dt, True).to(tl.float32)
            xbias += xi * (1 << code_exponent(i, 4, False))
            xsum += xi
        xbias3 = tl.reshape(xbias, [NG, BKW // NG])[None, :, :]
        xsum3 = tl.reshape(xsum, [NG, BKW // NG])[None, :, :]
        dot = tl.reshape(-(xbias3 + this_z[:, :, None] * xsum3), [BN, BKW])
        for i in tl.static_range(PER):
            xi = td._input_values(X, NORM_W, first + i, H, rstd, 1, dt, True).to(tl.float32)
            dot += biased_codes_at(this_words, i, 4, ASM) * xi[None, :]
        wide += tl.reshape(this_s[:, :, None] * tl.reshape(dot, [BN, NG, BKW // NG]), [BN, BKW])
    y = tl.sum(wide, axis=1).to(dt).to(tl.float32)  # [BN]: gate sums, then up sums, rounded as eager
    pair = tl.reshape(y, [2, CI])
    half = tl.arange(0, 2)[:, None]
    g = tl.sum(tl.where(half == 0, pair, 0.0), axis=0)
    u = tl.sum(tl.where(half == 1, pair, 0.0), axis=0)
    act = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)  # [CI]
    # down's share: word w of a row holds columns c0 + 8w .. c0 + 8w + 7
    a2 = tl.reshape(act, [DW, PER])
    col = tl.arange(0, PER)[None, :]
    a_sum = tl.sum(a2, axis=1)
    a_bias = tl.sum(a2 * tl.where(col % 2 == 0, 256.0, 16.0), axis=1)  # code_exponent: 2^8, 2^4 in turn
    for h0 in range(0, H, HB):
        this_words, this_s, this_z = d_words, d_s, d_z
        nxt = tl.where(h0 + HB < H, h0 + HB, h0)
        d_words = tl.load(d_at + nxt.to(tl.int64) * (I // PER))
        d_s = tl.load(S_D + (nxt + rh) * G_D + g_d).to(tl.float32)
        if HAS_Z:
            d_z = tl.load(Z_D + (nxt + rh) * G_D + g_d).to(tl.float32)
        dot = -(a_bias[None, :] + this_z[:, None] * a_sum[None, :])  # [HB, DW]
        for i in tl.static_range(PER):
            a_i = tl.sum(tl.where(col == i, a2, 0.0), axis=1)
            dot += biased_codes_at(this_words, i, 4, ASM) * a_i[None, :]
        share = this_s * tl.sum(dot, axis=1)
        if SUM == 0:
            tl.atomic_add(TOTALS + h0 + rh, (share * 4294967296.0).to(tl.int64), sem="relaxed")
        elif SUM == 1:
            tl.atomic_add(SHARES + h0 + rh, share, sem="relaxed")
        else:
            tl.store(SHARES + tl.program_id(0).to(tl.int64) * H + h0 + rh, share)
    if SUM == 2:
        return
    if arrived_last(ARRIVALS, 0, tl.num_programs(0)):
        for h0 in range(0, H, HB):
            if SUM == 0:
                total = tl.atomic_xchg(TOTALS + h0 + rh, tl.zeros([HB], tl.int64))
                out = (total.to(tl.float32) * (1.0 / 4294967296.0)).to(dt)
            else:
                out = tl.atomic_xchg(SHARES + h0 + rh, tl.zeros([HB], tl.float32)).to(dt)
            out = (out.to(tl.float32) + tl.load(X + h0 + rh).to(tl.float32)).to(dt)
            tl.store(Y + h0 + rh, out)
        tl.atomic_xchg(ARRIVALS, 0)


class Totals:
    """The fused kernel's int64 totals and arrival count, left at zero by every launch, and the room of
    the diagnostic sums: float32 totals (``how`` 1), or the shares of up to ``programs`` programs (2)."""

    def __init__(self, h: int, programs: int, device: torch.device) -> None:
        self.totals = torch.zeros(h, dtype=torch.int64, device=device)
        self.arrivals = torch.zeros(1, dtype=torch.int32, device=device)
        self.shares = torch.zeros(h * programs, dtype=torch.float32, device=device)


def fused_mlp(x, norm_w, eps, gu, down, tile, totals: Totals, out=None, warmup=False, how=0):
    """x [1, H] + the MLP of x's RMSNorm, one kernel (``tile``: CI, BK, HB, warps). ``how`` sums the
    programs' shares: 0 in int64 (the same total in any order), 1 in float32 atomics (order-dependent),
    2 not at all, each program storing its own (a diagnostic: what the MLP takes if summing were free;
    its output is not the row)."""
    ci, bk, hb, warps = tile
    h, i = down.shape
    gs = down.group_size
    assert gu.shape == (2 * i, h) and gu.group_size == gs and gs % ci == 0 and h % bk == 0 and h % hb == 0
    y = out if out is not None else torch.empty_like(x)
    z_gu = gu.zeros if gu.zeros is not None else gu.scales
    z_d = down.zeros if down.zeros is not None else down.scales
    grid = (i // ci,)
    assert how != 2 or totals.shares.numel() >= grid[0] * h
    args = (x, norm_w, gu.codes, gu.scales, z_gu, down.codes, down.scales, z_d, y, totals.totals, totals.arrivals,
            h, i, gu.scales.shape[1], down.scales.shape[1], eps)
    kw = dict(CI=ci, BK=bk, HB=hb, XB=pow2(h), GS=gs, HAS_Z=gu.zeros is not None, ASM=not interpreting(),
              SUM=how, SHARES=totals.shares, **launch_options(x.device), num_warps=warps)
    if warmup:
        return _fused_mlp_kernel.warmup(*args, grid=grid, **kw)
    _fused_mlp_kernel[grid](*args, **kw)
    return y


def reference(x, norm_w, eps, gu, down):
    """torch's row, rounded where the eager layer rounds (``triton_decode.reference_product``'s)."""
    i = down.shape[1]
    act = td.reference_product(x, gu, torch.arange(i), norm_weight=norm_w, eps=eps, glu=True).to(x.dtype)
    return td.reference_product(act, down, torch.arange(down.shape[0]), residual=x)


def check(device, h=256, i=512, tiles=((8, 128, 128, 4), (16, 256, 256, 4), (32, 128, 64, 4))):
    """Every tile's row against :func:`reference` on small random weights, with and without zero
    points; returns the tiles' first divergences (None: within the tuner's bounds)."""
    from edgeinfer.testing.products import random_packed

    torch.manual_seed(0)
    found = {}
    for zeros in (False, True):
        gu = random_packed(2 * i, h, 4, GS, device)
        down = random_packed(h, i, 4, GS, device)
        if zeros:
            for w in (gu, down):
                w.zeros = torch.randint(0, 16, w.scales.shape, device=device).to(w.scales.dtype)
        x = torch.randn(1, h, device=device, dtype=torch.bfloat16)
        norm_w = (torch.rand(h, device=device) + 0.5).to(torch.bfloat16)
        want = reference(x, norm_w, 1e-6, gu, down)
        totals = Totals(h, i // min(t[0] for t in tiles), device)
        for tile in tiles:
            got = fused_mlp(x, norm_w, 1e-6, gu, down, tile, totals)
            again = fused_mlp(x, norm_w, 1e-6, gu, down, tile, totals)  # the totals were left at zero
            key = f"{tile}{' zeros' if zeros else ''}"
            found[key] = kernels.divergence(got, want) or (None if torch.equal(got, again) else "not repeatable")
    return found


def pair_tiles(x, norm_w, eps, gu_ws, down_ws, space):
    """The fastest alone of every tile the step's tuner would time, for gate|up and for ``down``."""
    best = {}
    inter = down_ws[0].shape[1]
    act = torch.randn(1, inter, device=x.device, dtype=x.dtype)
    for name, ws, xin, kw in (("gate_up", gu_ws, x, {"norm_weight": norm_w, "eps": eps, "glu": True}),
                              ("down", down_ws, act, {"residual": torch.randn_like(x)})):
        n = ws[0].shape[0] // 2 if kw.get("glu") else ws[0].shape[0]
        outs = [torch.empty(1, n, dtype=x.dtype, device=x.device) for _ in ws]
        cands = td._candidates(ws[0], x.dtype, kw.get("glu", False))
        kernels.compile_ahead([lambda c=c, xin=xin, w=ws[0], o=outs[0], kw=kw: product(xin, w, c, o, space,
                                                                                        warmup=True, **kw)
                               for c in cands])
        right, wrong = td.right_tiles(xin, ws[0], cands, outs[0],
                                      lambda _x, w, c, out, **k: product(_x, w, c, out, space, **k), **kw)
        times = {}
        for c in right:
            times[c] = kernels.graph_time_us([lambda w=w, o=o, c=c, xin=xin, kw=kw: product(xin, w, c, o, space, **kw)
                                              for w, o in zip(ws, outs)], 10)
        c = min(times, key=times.get)
        best[name] = (c, times[c], {td._config_name(t): round(v, 2) for t, v in times.items()}, wrong)
    return best


def product(x, w, c, out, space, warmup=False, **kw):
    """One product as the decode step dispatches a tile."""
    return td.one_row_product(x, w, c, out=out, workspace=space, warmup=warmup, **kw)


def run(rounds: int):
    from edgeinfer.testing.products import random_packed

    dev = torch.device("cuda")
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "loadavg_before": os.getloadavg(), "shape": [HIDDEN, INTER], "group": GS}
    res["check"] = check(dev)
    print("check", json.dumps(res["check"]), flush=True)
    torch.manual_seed(0)
    gu_ws = [random_packed(2 * INTER, HIDDEN, 4, GS, dev) for _ in range(LAYERS)]
    down_ws = [random_packed(HIDDEN, INTER, 4, GS, dev) for _ in range(LAYERS)]
    res["mb_a_layer"] = (gu_ws[0].nbytes + down_ws[0].nbytes) / 1e6
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    norm_w = (torch.rand(HIDDEN, device=dev) + 0.5).to(torch.bfloat16)
    eps, space, totals = 1e-6, SplitWorkspace(dev), Totals(HIDDEN, INTER // min(t[0] for t in TILES), dev)
    t0 = time.time()
    kernels.compile_ahead([lambda t=t, how=how: fused_mlp(x, norm_w, eps, gu_ws[0], down_ws[0], t, totals,
                                                          warmup=True, how=how)
                           for t in TILES for how in HOWS])
    res["compile_s"] = round(time.time() - t0, 1)
    want = reference(x, norm_w, eps, gu_ws[0], down_ws[0])
    fused_ok, res["fused_wrong"] = [], {}
    for t in TILES:
        for how in (0, 1):  # unsummed shares are not the row
            try:
                why = kernels.divergence(fused_mlp(x, norm_w, eps, gu_ws[0], down_ws[0], t, totals, how=how), want)
            except Exception as e:  # noqa: BLE001 - a tile that fails is recorded, the others go on
                why = repr(e)[:300]
            if why is not None:
                res["fused_wrong"][f"{t} {HOWS[how]}"] = why
        if not any(k.startswith(str(t)) for k in res["fused_wrong"]):
            fused_ok.append(t)
    best = pair_tiles(x, norm_w, eps, gu_ws, down_ws, space)
    res["pair_alone"] = {k: {"tile": td._config_name(v[0]), "us": round(v[1], 2), "all": v[2], "wrong": v[3]}
                         for k, v in best.items()}
    print("pair alone", json.dumps({k: (v["tile"], v["us"]) for k, v in res["pair_alone"].items()}), flush=True)
    mids = [torch.empty(1, INTER, dtype=x.dtype, device=dev) for _ in range(LAYERS)]
    outs = [torch.empty_like(x) for _ in range(LAYERS)]
    (gu_tile, *_), (d_tile, *_) = best["gate_up"], best["down"]

    def pair_calls():
        calls = []
        for gu, d, mid, o in zip(gu_ws, down_ws, mids, outs):
            calls.append(lambda gu=gu, mid=mid: product(x, gu, gu_tile, mid, space, norm_weight=norm_w, eps=eps,
                                                        glu=True))
            calls.append(lambda d=d, mid=mid, o=o: product(mid, d, d_tile, o, space, residual=x))
        return calls

    for fn in pair_calls()[:2]:
        fn()
    res["pair_against_torch"] = kernels.divergence(outs[0], want)
    variants = {"pair": pair_calls()}
    for t in fused_ok:
        for how, summed in HOWS.items():
            variants[f"fused {t} {summed}"] = [
                lambda gu=gu, d=d, o=o, t=t, how=how: fused_mlp(x, norm_w, eps, gu, d, t, totals, out=o, how=how)
                for gu, d, o in zip(gu_ws, down_ws, outs)]
    times = {k: [] for k in variants}
    for _ in range(rounds):  # every variant in turns, a graph of 28 layers each
        for k, calls in variants.items():
            times[k].append(kernels.graph_time_us(calls, 10) * len(calls) / LAYERS)
    res["us_a_layer"] = {k: {"median": round(statistics.median(v), 2), "runs": [round(t, 2) for t in v]}
                         for k, v in times.items()}
    res["loadavg_after"] = os.getloadavg()
    for k, v in sorted(res["us_a_layer"].items(), key=lambda kv: kv[1]["median"]):
        print(f"{k}: {v['median']} µs a layer ({res['mb_a_layer'] / v['median']:.2f} TB/s)", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe-fused-mlp.json"), "w") as f:
        json.dump(res, f, indent=1)


def sass(arch: int = 90):
    """Each tile compiled for sm_``arch`` without a GPU, its shares summed in int64: registers, spills,
    instructions, atomics."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from edgeinfer.testing.triton_compile import (
        disassembled,
        instructions,
        opcodes,
        resources,
    )

    fn = _fused_mlp_kernel
    names = fn.arg_names
    types = {**{a: "*bf16" for a in ("X", "NORM_W", "S_GU", "Z_GU", "S_D", "Z_D", "Y")}, "GU": "*i32", "D": "*i32",
             "TOTALS": "*i64", "ARRIVALS": "*i32", "SHARES": "*fp32", **dict.fromkeys(("H", "I", "G_GU", "G_D"), "i32"), "eps": "fp32"}
    for ci, bk, hb, warps in TILES:
        given = {"CI": ci, "BK": bk, "HB": hb, "XB": pow2(HIDDEN), "GS": GS, "HAS_Z": False, "ASM": True,
                 "PDL": arch >= 90, "SUM": 0}
        source = ASTSource(fn, {n: types.get(n, "constexpr") for n in names},
                           {(names.index(k),): v for k, v in given.items()})
        binary = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": warps, "launch_pdl": arch >= 90}).asm["cubin"]
        ins = instructions(disassembled(binary))
        ops = opcodes(ins)
        use = resources(binary)
        print(f"sm_{arch} CI {ci} BK {bk} HB {hb} {warps}w: {len(ins)} instructions, {use.get('REG')} registers, "
              f"{use.get('STACK')} bytes spilled; LDG {ops['LDG']}, FFMA {ops['FFMA']}, LOP3 {ops['LOP3']}, "
              f"ATOM/RED {ops['ATOMG'] + ops['RED']}", flush=True)


def main():
    if "--sass" in sys.argv:
        for arch in (90, 87):
            sass(arch)
        return
    check_or_run(check, run)


if __name__ == "__main__":
    main()
