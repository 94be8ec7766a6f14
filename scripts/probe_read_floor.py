"""Diagnostic probe (not a benchmark): what a kernel that only reads a 4-bit product's bytes takes in
the batch-1 step's chain, beside the product itself, on a GPU.

    OUT=folder python scripts/probe_read_floor.py              # on a GPU
    TRITON_INTERPRET=1 python scripts/probe_read_floor.py --check   # no GPU: the read kernel reads every word

Why. Each 4-bit product of a Qwen2-VL-2B layer at batch 1 streams 0.5–1.4 TB/s, far from the
memory's rate, and the step is a chain of one kernel a product. How much of a product's time is
its bytes, how much the chain around any kernel of its size, and how much the product's own
arithmetic and waits? The read kernel answers the first two: it reads the product's packed words
and scales, 16 bytes a load (or 4, one word a thread as ``packed_gemv`` reads), folds them into
one number a program and writes it, launched as the step launches its kernels (a dependent of the
kernel before it, its first step's words read before the wait). Its programs read STEPS steps of
BLOCK words each; with DEP each step's address depends on the step before's words, so a program
waits a memory round trip a step, as a product whose step multiplies before the next step's words
are asked for does.

Timed as the tuner times a product: 28 copies of the weights (one per layer, so reads come from
memory) replayed from one CUDA graph, µs a call. For each product: the fastest read tile of the
sweep, the read tile shaped like the product's own (its programs' steps and bytes a step), the
product as the step fuses it (the fastest alone of every tile the tuner times) and the same tile
without its prologue and epilogue, and beside the tuner's tiles a few it does not time
(``EXTRA_TILES``). Then a layer's four products in the step's order over 28 layers, read kernels
against the products (and against the products on the fastest tiles with the extra ones, where
those differ), in turns, ``ROUNDS`` times; medians. The attention is not in the chain. Writes
``$OUT/probe-read-floor.json`` (load averages before and after).
"""
import itertools
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels
from edgeinfer.quant.kernels import and_or, await_inputs
from edgeinfer.quant.launching import SplitWorkspace, interpreting, launch_options
from edgeinfer.testing.products import QWEN2_VL_2B as PRODUCTS
from edgeinfer.testing.products import check_or_run, layer_calls, right_one_row_tiles

LAYERS, GS = 28, 128
# (BLOCK words a step, STEPS a program, warps, VEC words a load, DEP)
READ_TILES = [t for t in itertools.product((512, 1024, 2048), (1, 2, 3, 6), (4, 8), (4, 1), (0, 1))
              if not (t[4] and t[1] == 1)]  # one step depends on nothing
WORKS = (2, 4, 7, 10, 14)  # rounds of ``_work`` a word: 6 to 42 instructions, ``packed_gemv``'s K step spending 34–41
# ``packed_gemv`` tiles the tuner does not time, timed beside its own: more rows a thread (x's work
# shared by more of them), or fewer registers (more programs an SM); none spills on sm_90
EXTRA_TILES = tuple(td.PackedGemvConfig(*t) for t in (
    (32, 128, 4), (64, 128, 4), (64, 256, 4), (64, 256, 8), (32, 256, 2), (32, 128, 2),
    (32, 128, 4, 8), (64, 128, 4, 8), (32, 256, 4, 8), (32, 128, 4, 4)))


@triton.jit
def _work(words, acc, WORK: tl.constexpr, ASM: tl.constexpr):
    """WORK rounds of a shift, an and-or (one ``lop3``) and a multiply-add on every word, into ``acc``
    (float32): three instructions a word a round, the mix of a 4-bit product's
    (``kernels.biased_codes_at``). Each round's shift and constant differ, so none is shared."""
    for j in tl.static_range(WORK):
        f = and_or(words >> (j % 31 + 1), 0x000F000F, 0x4B004B00 + j, ASM).to(tl.float32, bitcast=True)
        acc = f * 1.0001 + acc
    return acc


@triton.jit
def _read_kernel(W, S, SINK, WORKED, n_words, n_scales, scales_a_program, BLOCK: tl.constexpr,
                 STEPS: tl.constexpr, SB: tl.constexpr, VEC: tl.constexpr, DEP: tl.constexpr, WORK: tl.constexpr,
                 ASM: tl.constexpr, PDL: tl.constexpr):
    """Program p reads words [p·STEPS·BLOCK, (p+1)·STEPS·BLOCK) of ``W`` and its share of the
    scales ``S`` (int32 views), folds them with xor and writes the result to ``SINK[p]``. With
    ``WORK``, each word also goes through :func:`_work` once the kernels before have finished, as a
    product multiplies once x is there, and the sum goes to ``WORKED[p]``."""
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    if VEC == 1:  # a thread's words not side by side: 4-byte loads, still coalesced across a warp
        i = i ^ 1
    base = pid.to(tl.int64) * (STEPS * BLOCK)
    at = base + i
    acc = tl.load(W + at, mask=at < n_words, other=0)
    si = pid * scales_a_program + tl.arange(0, SB)
    s_ok = (si < n_scales) & (tl.arange(0, SB) < scales_a_program)
    scales = tl.load(S + si, mask=s_ok, other=0)
    await_inputs(PDL)
    worked = _work(acc, tl.zeros([BLOCK], tl.float32), WORK, ASM)
    for s in tl.static_range(1, STEPS):
        at = base + s * BLOCK + i
        if DEP:  # the step's address waits for the step before's words (the term is zero unless every word
            # is -1), in whole steps, so that the loads stay as wide as without it
            at += (tl.max(acc, axis=0) == -1).to(tl.int64) * BLOCK
        words = tl.load(W + at, mask=at < n_words, other=0)
        acc ^= words
        worked = _work(words, worked, WORK, ASM)
    total = tl.xor_sum(acc, axis=0) ^ tl.xor_sum(scales, axis=0)
    tl.store(SINK + pid, total)
    if WORK:
        tl.store(WORKED + pid, tl.sum(worked, axis=0))


def read_call(words: torch.Tensor, scales: torch.Tensor, sink: torch.Tensor, tile, warmup=False):
    """The read kernel over ``words`` and ``scales`` (int32 views) at ``tile`` (BLOCK, STEPS, warps,
    VEC, DEP[, WORK]); writes ``sink`` (int32, and with WORK its float32 view past the programs')."""
    block, steps, warps, vec, dep, work = (*tile, 0)[:6]
    n, ns = words.numel(), scales.numel()
    programs = triton.cdiv(n, block * steps)
    per = triton.cdiv(ns, programs)
    args = (words, scales, sink, sink[programs:].view(torch.float32), n, ns, per)
    kw = dict(BLOCK=block, STEPS=steps, SB=triton.next_power_of_2(max(per, 1)), VEC=vec, DEP=dep, WORK=work,
              ASM=not interpreting(), **launch_options(words.device), num_warps=warps)
    if warmup:
        return _read_kernel.warmup(*args, grid=(programs,), **kw)
    assert sink.numel() >= 2 * programs
    _read_kernel[(programs,)](*args, **kw)


def expected(words: torch.Tensor, scales: torch.Tensor, tile) -> torch.Tensor:
    """What the read kernel writes for ``tile``, by torch."""
    block, steps = tile[0], tile[1]
    n, ns = words.numel(), scales.numel()
    programs = triton.cdiv(n, block * steps)
    per = triton.cdiv(ns, programs)
    w = torch.nn.functional.pad(words.flatten(), (0, programs * block * steps - n)).view(programs, -1)
    s = torch.nn.functional.pad(scales.flatten(), (0, programs * per - ns)).view(programs, -1)
    return _xor_rows(w) ^ _xor_rows(s)


def _xor_rows(t: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(t.shape[0], dtype=torch.int32, device=t.device)
    for j in range(t.shape[1]):
        out ^= t[:, j]
    return out


def int32_views(w):
    """A packed weight's words and scales as flat int32 tensors (the scales' bytes, padded to 4)."""
    s = w.scales.flatten().view(torch.int16)
    if s.numel() % 2:
        s = torch.nn.functional.pad(s, (0, 1))
    return w.codes.flatten(), s.view(torch.int32)


def check(device) -> dict:
    """Every tile shape's sink against :func:`expected` on a small random weight (odd sizes, so the
    last program reads a part of a step): None where equal."""
    from edgeinfer.testing.products import random_packed

    torch.manual_seed(0)
    w = random_packed(96, 1280, 4, GS, device)
    words, scales = int32_views(w)
    found = {}
    for tile in [(64, s, 1, v, d) for s in (1, 3) for v in (4, 1) for d in (0, 1) if not (d and s == 1)] + [
            (64, 3, 1, 1, 1, 2)]:
        sink = torch.zeros(words.numel(), dtype=torch.int32, device=device)
        read_call(words, scales, sink, tile)
        want = expected(words, scales, tile)
        got = sink[:want.numel()]
        found[str(tile)] = None if torch.equal(got, want) else f"{int((got != want).sum())} programs differ"
    return found


def graph_us(calls) -> float:
    return kernels.graph_time_us(calls, 10)


def read_calls(views: list, sink: torch.Tensor, tile) -> list:
    """The read kernel at ``tile`` over each layer's copy (``views``: :func:`int32_views` of each)."""
    return [lambda v=v: read_call(v[0], v[1], sink, tile) for v in views]


def run(rounds: int):
    from edgeinfer.testing.products import fused_inputs, random_packed

    dev = torch.device("cuda")
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "group": GS, "loadavg_before": os.getloadavg(), "read_tiles": READ_TILES}
    res["check"] = check(dev)
    print("check", json.dumps(res["check"]), flush=True)
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    ws = {name: [random_packed(n, k, 4, GS, dev) for _ in range(LAYERS)] for name, n, k, _ in PRODUCTS}
    views = {name: [int32_views(w) for w in wl] for name, wl in ws.items()}
    sink = torch.zeros(max(v[0].numel() for vl in views.values() for v in vl) // 32 + 1, dtype=torch.int32,
                       device=dev)
    t0 = time.time()
    words0, scales0 = views["gate_up"][0]
    kernels.compile_ahead([lambda t=t: read_call(words0, scales0, sink, t, warmup=True) for t in READ_TILES])
    res["compile_s"] = round(time.time() - t0, 1)
    res["products"], best_read, best_ours, best_extra, best_packed = {}, {}, {}, {}, {}
    for name, n, k, kind in PRODUCTS:
        x, kw = fused_inputs(kind, n, k, dev)
        outs_n = n // 2 if kw.get("glu") else n
        outs = [torch.empty(1, outs_n, dtype=x.dtype, device=dev) for _ in range(LAYERS)]
        entry = {"mb": round(ws[name][0].nbytes / 1e6, 3)}
        reads = {}
        for t in READ_TILES:
            reads[t] = graph_us(read_calls(views[name], sink, t))
        best = min(reads, key=reads.get)
        best_read[name] = best
        entry["read_all"] = {str(t): round(v, 2) for t, v in reads.items()}
        entry["read_best"] = {"tile": best, "us": round(reads[best], 2),
                              "tb_s": round(ws[name][0].nbytes / reads[best] / 1e6, 2)}
        tuner = td._candidates(ws[name][0], x.dtype, kw.get("glu", False))
        cands = tuner + tuple(c for c in EXTRA_TILES if c not in tuner)
        kernels.compile_ahead([f for c in cands for f in layer_calls(x, ws[name][:1], c, outs, space, warmup=True,
                                                                        **kw)])
        right, wrong = right_one_row_tiles(x, ws[name][0], cands, outs[0], space, **kw)
        ours = {c: graph_us(layer_calls(x, ws[name], c, outs, space, **kw)) for c in right}
        extra = min(ours, key=ours.get)
        c = min((t for t in ours if t in tuner), key=ours.get)
        best_ours[name] = (c, x, kw, outs)
        best_extra[name] = extra
        entry["ours_all"] = {td._config_name(t) + ("" if t in tuner else " (extra)"): round(v, 2)
                             for t, v in ours.items()}
        entry["ours_wrong"] = wrong
        entry["ours"] = {"tile": td._config_name(c), "us": round(ours[c], 2),
                         "tb_s": round(ws[name][0].nbytes / ours[c] / 1e6, 2)}
        entry["ours_with_extra"] = {"tile": td._config_name(extra), "us": round(ours[extra], 2)}
        c = best_packed[name] = min((t for t in ours if t in tuner and isinstance(t, td.PackedGemvConfig)),
                                    key=ours.get)
        entry["ours_packed"] = {"tile": td._config_name(c), "us": round(ours[c], 2)}
        bases = [best]
        # the fastest packed_gemv tile bare, and the read tile of its shape
        bare_outs = [torch.empty(1, n, dtype=x.dtype, device=dev) for _ in range(LAYERS)]
        entry["ours_bare_us"] = round(graph_us(layer_calls(x, ws[name], c, bare_outs, space)), 2)
        bk = max(32, min(c.bk, triton.next_power_of_2(k)))
        steps = triton.cdiv(triton.cdiv(k, bk), c.split)
        block = c.bn * bk // 8  # words of a program's step
        shaped = (block, steps, c.warps, 1, int(steps > 1))
        if block >= 32 * c.warps and shaped not in reads:
            read_call(*views[name][0], sink, shaped)
            reads[shaped] = graph_us(read_calls(views[name], sink, shaped))
        if shaped in reads:
            entry["read_shaped"] = {"tile": shaped, "us": round(reads[shaped], 2)}
            bases.append(shaped)
        worked = [(*t, work) for t in bases for work in WORKS]  # the read tiles again, with work on each word
        kernels.compile_ahead([lambda t=t, v=views[name][0]: read_call(*v, sink, t, warmup=True) for t in worked])
        entry["read_worked"] = {str(t): round(graph_us(read_calls(views[name], sink, t)), 2) for t in worked}
        res["products"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if not k.endswith("_all")}), flush=True)

    def chain(kind):
        per_product = []
        for name, *_ in PRODUCTS:
            if kind == "read":
                per_product.append(read_calls(views[name], sink, best_read[name]))
            else:
                c, x, kw, outs = best_ours[name]
                c = {"extra": best_extra, "packed": best_packed}.get(kind, {name: c})[name]
                per_product.append(layer_calls(x, ws[name], c, outs, space, **kw))
        calls = [f for layer in zip(*per_product) for f in layer]  # a layer's products in order, layer by layer
        return calls

    variants = {"read": chain("read"), "ours": chain("ours")}
    if any(best_packed[name] != best_ours[name][0] for name in best_ours):
        variants["ours, packed_gemv's tiles"] = chain("packed")
    if any(best_extra[name] != best_ours[name][0] for name in best_ours):
        variants["ours with the extra tiles"] = chain("extra")
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, calls in variants.items():
            times[k].append(graph_us(calls) * len(calls) / LAYERS)
    mb = sum(ws[name][0].nbytes for name, *_ in PRODUCTS) / 1e6
    res["chain_us_a_layer"] = {k: {"median": round(statistics.median(v), 2), "runs": [round(t, 2) for t in v],
                                   "tb_s": round(mb / statistics.median(v), 2)} for k, v in times.items()}
    res["mb_a_layer"] = round(mb, 3)
    res["loadavg_after"] = os.getloadavg()
    print("chain", json.dumps(res["chain_us_a_layer"]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe-read-floor.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def main():
    check_or_run(check, run)


if __name__ == "__main__":
    main()
