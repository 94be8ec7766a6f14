"""Diagnostic probe (not a benchmark): products of a few rows (a decode step of 4, 16, 64 sequences)
with packed 4-bit and 8-bit weights on a GPU, ``kernels.packed_mm``'s tiles beside cuBLAS bf16.

    OUT=folder python scripts/probe_packed_mm.py

The four products of a Qwen2-VL-2B layer over 28 copies of their weight (one per layer, so that
reads come from memory as in a step), 4-bit with g128 symmetric bf16 scales, and the int8
``lm_head`` (one scale a row) once; microseconds a call, the copies' calls replayed from one CUDA
graph (``triton_decode.graph_time_us``). Every tile is checked against the product with the
weight dequantized to bf16 (largest difference over the largest output). Writes
``$OUT/probe-packed-mm.json``.

For 4-bit weights and up to 16 rows it also times the tensor-core kernel's tiles
(``/tc`` in a tile's name), x read from memory each step and x put in shared memory
(``/x-shared``), each with a lane's words side by side too (``/wide``), and the staged tiles
(``/staged``: every step's words in shared memory at once, not yet run on a GPU), at every row count
up to 16, whichever of them the tuner times there:
``ROWS=1,4,16 OUT=folder python scripts/probe_packed_mm.py`` compares them. ``PRODUCTS=down,qkv``
times only the products named, ``KINDS=tc`` only the tensor-core tiles (``dot``: only the others).

The run docs/results/probes/h200-packed-mm.json also timed, at 16 rows (``classes``), the
kernel that ``packed_mm`` had before (a dot per value ``i`` of the words, each value dequantized
with its scale), since removed; it used ``mm_candidates`` of that time.
"""
import itertools, json, os, time, traceback

import torch
import triton

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels
from edgeinfer.testing.products import random_packed

OUT = os.environ.get("OUT", "/tmp")
DEADLINE = time.time() + float(os.environ.get("PROBE_SECONDS", "400"))
ROWS = [int(r) for r in os.environ.get("ROWS", "4,16,64").split(",")]
dev, bf = torch.device("cuda"), torch.bfloat16
LAYERS = 28
res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
       "layers": LAYERS}
PRODUCTS = {"gate_up": (17920, 1536, 4, 128), "down": (1536, 8960, 4, 128), "qkv": (2048, 1536, 4, 128),
            "o": (1536, 1536, 4, 128), "lm_head": (151936, 1536, 8, 1536)}


def save():
    json.dump(res, open(f"{OUT}/probe-packed-mm.json", "w"), indent=1)


def new_mm(x, w, cfg, warmup=False):
    return kernels.packed_mm(x, w.codes, w.scales, None, w.layout, cfg, warmup=warmup)


def key(c):
    return (f"{c.bn}x{c.bk}/{c.warps}w/{c.stages}s/split{c.split}" + ("/wa" if c.w_a else "")
            + ("/tc" if c.mma else "") + ("/x-shared" if c.x_shared else "") + ("/wide" if c.wide else "")
            + ("/staged" if c.staged else ""))


def sweep(fn, ws, x, want, configs):
    scale = want.abs().max().item()
    out = {}
    for cfg in configs:
        if time.time() > DEADLINE:
            res.setdefault("stopped", []).append("deadline")
            break
        try:
            err = (fn(x, ws[0], cfg).float() - want).abs().max().item() / scale
            out[key(cfg)] = (round(td.graph_time_us([lambda w=w: fn(x, w, cfg) for w in ws]), 2), round(err, 5))
        except Exception:
            out[key(cfg)] = (None, traceback.format_exc()[-600:])
    return out


def best(table):
    ok = {c: v for c, v in table.items() if v[0] is not None}
    return (lambda c: {"config": c, "us": ok[c][0], "err": ok[c][1]})(min(ok, key=lambda c: ok[c][0])) if ok else None


def tensor_core_configs(layout, rows):
    """The tensor-core tiles for ``rows``: both ways of reading x (the tuner times x loaded each step
    up to 8 rows, x in shared memory at 16), each also with a lane's words side by side (``/wide``),
    and the staged tiles (``/staged``: every step's words in shared memory at once,
    ``kernels.staged_mma_candidates``)."""
    if layout.bits != 4 or rows > 16:
        return []
    bm = 8 if rows <= 8 else 16

    def fits(bk, split, shared):
        return layout.k // bk >= split and layout.group_constexpr % bk == 0 and (
            not shared or kernels.x_shared_bytes(layout.k, bk, split, bm) <= kernels.X_SHARED_BYTES)

    tuned = [kernels.MmConfig(bn, bk, split, stages=stages, mma=True, x_shared=shared)
             for shared, tiles in ((False, kernels.MMA_TILES), (True, kernels.X_SHARED_TILES))
             for bn, bk, split in tiles for stages in (2, 4) if fits(bk, split, shared)]
    wide = [kernels.MmConfig(bn, bk, split, stages=stages, mma=True, x_shared=shared, wide=True)
            for shared, tiles in ((False, kernels.MMA_TILES), (True, kernels.X_SHARED_TILES))
            for bn, bk, split in tiles for stages in (2, 4) if fits(bk, split, shared)]
    return tuned + wide + kernels.staged_mma_candidates(layout, bm)


def new_configs(layout, bks):
    out = []
    for bn, bk, split, w_a in itertools.product((32, 64, 128), bks, (1, 2, 4, 8), (False, True)):
        if split > 1 and layout.k < bk * split:
            continue
        out.append(kernels.MmConfig(bn, bk, split, w_a=w_a))
        if bn == 128:
            out.append(kernels.MmConfig(bn, bk, split, warps=8, w_a=w_a))
    return out


def product(name):
    n, k, bits, gs = PRODUCTS[name]
    copies = 1 if name == "lm_head" else LAYERS
    ws = [random_packed(n, k, bits, gs, dev) for _ in range(copies)]
    dense0 = ws[0].dequantize(bf)
    r = {"shape": [n, k], "bits": bits, "group": gs, "copies": copies, "packed_mb": round(ws[0].nbytes / 1e6, 3)}
    bks = (64, 128) if gs == 128 else (128, 256)
    dense = [dense0] + [torch.randn(n, k, device=dev, dtype=bf) for _ in range(copies - 1)]
    for m in ROWS:
        t0 = time.time()
        x = torch.randn(m, k, device=dev, dtype=bf)
        want = (x @ dense0.t()).float()
        row = {"cublas_bf16_us": round(td.graph_time_us([lambda d=d: x @ d.t() for d in dense]), 2)}
        kinds = os.environ.get("KINDS", "dot,tc").split(",")
        configs = ((new_configs(ws[0].layout, bks) if "dot" in kinds else [])
                   + (tensor_core_configs(ws[0].layout, m) if "tc" in kinds else []))
        kernels.compile_ahead(lambda c=c: new_mm(x, ws[0], c, warmup=True) for c in configs)  # on every core
        row["compile_s"] = round(time.time() - t0, 1)
        table = sweep(new_mm, ws, x, want, configs)
        row["new"], row["new_best"] = table, best(table)
        row["seconds"] = round(time.time() - t0, 1)
        r[f"m{m}"] = row
        print(name, m, {k2: v for k2, v in row.items() if k2 not in ("new", "classes")}, flush=True)
    return r


def main():
    names = os.environ.get("PRODUCTS", ",".join(PRODUCTS)).split(",")
    unknown = sorted(set(names) - set(PRODUCTS))
    if unknown:
        raise SystemExit(f"PRODUCTS names {unknown}; the products are {sorted(PRODUCTS)}")
    res["products"] = names
    for name in names:
        try:
            res[name] = product(name)
        except Exception:
            res[name] = {"error": traceback.format_exc()[-3000:]}
            print(name, res[name]["error"], flush=True)
        save()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
