"""Diagnostic probe (not a benchmark): one-row products with packed 4-bit and 8-bit weights on a GPU,
the tiles of ``triton_decode.packed_gemv`` (K split or not) beside the bf16 GEMV.

    OUT=folder python scripts/probe_packed_gemv.py

Each product of a Qwen2-VL-2B layer with the prologue and epilogue the fused decode step gives it
(q|k|v: RMSNorm and bias; o: residual; gate|up: RMSNorm; down: SiLU(gate)·up and residual) over
28 copies of its weight (one per layer, so that reads come from memory as in a step), g128
symmetric scales in bf16; the int8 ``lm_head`` (one scale a row) once. Microseconds a call: the
28 calls replayed from one CUDA graph (``triton_decode.graph_time_us``). Every tile is checked
against the bf16 GEMV of the dequantized weight on the first copy (largest difference over the
largest output). ``layer``: the four products of each of the 28 layers in sequence at their
fastest tiles. Writes ``$OUT/probe-packed-gemv.json``.

The run docs/results/probes/h200-packed-gemv.json was made by an earlier form of this script and
kernel: its ``old_best`` and ``layer_w*.old`` time the fused step's earlier packed path (a branch of
``triton_decode.gemv``, since removed), its errors are against that path, and its ``3d`` and
``cls`` tiles are two ways of unpacking that the kernel no longer has (``cls`` loaded x once per
value of a word); h200-packed-gemv-columns.json timed the present unpacking (x's columns taken
apart in registers) in a copy of the kernel against the ``cls`` one.
"""
import itertools, json, os, time, traceback

import torch

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant.packed import PackedMatrix
from edgeinfer.testing.products import fused_inputs

OUT = os.environ.get("OUT", "/tmp")
DEADLINE = time.time() + float(os.environ.get("PROBE_SECONDS", "420"))
dev, bf = torch.device("cuda"), torch.bfloat16
LAYERS = 28
res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "layers": LAYERS}
PRODUCTS = {  # name: (N, K, prologue/epilogue)
    "qkv": (2048, 1536, "norm+bias"), "o": (1536, 1536, "residual"),
    "gate_up": (17920, 1536, "norm+glu"), "down": (1536, 8960, "residual"),
}
DENSE_BEST = {"qkv": (4, 1024, 8, 2), "o": (2, 1024, 4, 2), "gate_up": (8, 512, 4, 2), "down": (8, 1024, 8, 2),
              "lm_head": (2, 512, 2, 3)}


def save():
    json.dump(res, open(f"{OUT}/probe-packed-gemv.json", "w"), indent=1)


def packed(n, k, bits, gs):
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=dev)  # random codes
    scales = (torch.rand(n, k // gs, device=dev) * 0.004 + 0.001).to(bf)
    return PackedMatrix(words, scales, None, bits, gs, (n, k))


def inputs(name, n, k):
    return fused_inputs(PRODUCTS.get(name, (0, 0, "norm"))[2], n, k, dev)


def timed(calls):
    return round(td.graph_time_us(calls), 2)


def sweep(name, ws, x, kw, configs, workspace):
    """{config: (µs, error against the bf16 GEMV of the dequantized weight)} for the kernel's tiles."""
    outs = [torch.empty(1, ws[0].shape[0], device=dev, dtype=bf) for _ in ws]
    want = td.gemv(x, ws[0].dequantize(bf), **kw).float()
    scale = want.abs().max().item()
    out = {}
    for cfg in configs:
        if time.time() > DEADLINE:
            res.setdefault("stopped", []).append(f"{name}: deadline")
            break
        try:
            got = td.packed_gemv(x, ws[0], cfg, workspace=workspace, **kw).float()
            err = (got - want).abs().max().item() / scale
            us = timed([lambda w=w, o=o: td.packed_gemv(x, w, cfg, out=o, workspace=workspace, **kw)
                        for w, o in zip(ws, outs)])
            out[cfg] = (us, round(err, 5))
        except Exception:
            out[cfg] = (None, traceback.format_exc()[-600:])
    return out


def key(c):
    return f"{c.bn}x{c.bk}/{c.warps}w/s{c.split}"


def best_of(table):
    ok = {c: v for c, v in table.items() if v[0] is not None}
    return min(ok, key=lambda c: ok[c][0]) if ok else None


def product(name, bits, n, k, gs, copies, bns, bks, warps, splits):
    t0 = time.time()
    ws = [packed(n, k, bits, gs) for _ in range(copies)]
    x, kw = inputs(name, n, k)
    workspace = td.SplitWorkspace(dev)
    r = {"shape": [n, k], "bits": bits, "group": gs, "copies": copies, "mb": round(ws[0].nbytes / 1e6, 3)}
    configs = [td.PackedGemvConfig(bn, bk, w, s) for bn, bk, w, s in
               itertools.product(bns, bks, warps, splits) if k // bk >= s or s == 1]
    table = sweep(name, ws, x, kw, configs, workspace)
    r["new"] = {key(c): v for c, v in table.items()}
    b = best_of(table)
    if b is not None:
        r["new_best"] = {"config": key(b), "us": table[b][0], "err": table[b][1],
                         "gb_s": round(r["mb"] / table[b][0] * 1e3, 1)}
    r["max_err"] = max((v[1] for v in table.values() if v[0] is not None), default=None)
    r["seconds"] = round(time.time() - t0, 1)
    return r, ws, x, kw, (b, table[b][0] if b is not None else None)


def dense_best(name, n, k, copies):
    ws = [torch.randn(n, k, device=dev, dtype=bf) for _ in range(copies)]
    x, kw = inputs(name, n, k)
    c = td.GemvConfig(*DENSE_BEST[name])
    outs = [torch.empty(1, n, device=dev, dtype=bf) for _ in ws]
    return {"config": DENSE_BEST[name], "us": timed([lambda w=w, o=o: td.gemv(x, w, config=c, out=o, **kw)
                                                     for w, o in zip(ws, outs)]),
            "mb": round(n * k * 2 / 1e6, 3)}


def layer(bits, chosen):
    """µs a layer: the four products of each of the 28 layers in turn, each path at its fastest tiles."""
    parts = [chosen[f"w{bits}_{name}"] for name in PRODUCTS]
    workspace = td.SplitWorkspace(dev)
    calls = [lambda w=ws[i], x=x, kw=kw, c=nb: td.packed_gemv(x, w, c, workspace=workspace, **kw)
             for i in range(LAYERS) for ws, x, kw, nb in parts]
    return {"new": round(td.graph_time_us(calls) * len(PRODUCTS), 2)}


def step(label, fn):
    try:
        res[label] = fn()
    except Exception:
        res[label] = {"error": traceback.format_exc()[-3000:]}
    save()
    print(label, json.dumps({k: v for k, v in res[label].items() if k != "new"})[:1500], flush=True)


def main():
    chosen = {}
    for bits, bks in ((4, (256, 512, 1024)), (8, (128, 256, 512))):
        for name, (n, k, _) in PRODUCTS.items():
            def one(name=name, n=n, k=k, bits=bits, bks=bks):
                big = name in ("gate_up", "down")
                r, ws, x, kw, (nb, nb_us) = product(
                    name, bits, n, k, 128, LAYERS,
                    (4, 8, 16) if big else (2, 4, 8, 16), bks, (4,), (1, 2, 4, 8, 16))
                times = {nb: nb_us}
                extra = sweep(name, ws, x, kw, [td.PackedGemvConfig(nb.bn, nb.bk, w, nb.split)
                                                for w in (2, 8)], td.SplitWorkspace(dev))
                r["warps"] = {key(c): v for c, v in extra.items()}  # other warp counts for the fastest tile
                times.update({c: v[0] for c, v in extra.items() if v[0] is not None})
                chosen[f"w{bits}_{name}"] = (ws, x, kw, min(times, key=times.get))
                return r
            step(f"w{bits}_{name}", one)
        step(f"layer_w{bits}", lambda bits=bits: layer(bits, chosen))
        for name in PRODUCTS:  # free the copies
            chosen.pop(f"w{bits}_{name}", None)
        torch.cuda.empty_cache()
    step("w8_lm_head", lambda: product("lm_head", 8, 151936, 1536, 1536, 1, (4, 8, 16, 32),
                                       (256, 512, 1024), (4, 8), (1,))[0])
    step("bf16", lambda: {**{name: dense_best(name, n, k, LAYERS) for name, (n, k, _) in PRODUCTS.items()},
                          "lm_head": dense_best("lm_head", 151936, 1536, 1)})


if __name__ == "__main__":
    main()
