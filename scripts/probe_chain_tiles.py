"""Diagnostic probe (not a benchmark): what each of a layer's four 4-bit products costs in the batch-1
step's chain on the staged kernel's fastest tile and on ``packed_gemv``'s, every mix of the two, on a GPU.

    OUT=folder ROUNDS=5 python scripts/probe_chain_tiles.py

Why. Timed alone (28 copies of one product from one CUDA graph, as the tuner times a tile) the staged
tiles are faster, yet in an H100's step they gained nothing. The step's tuner only says which set of
tiles ended fastest, not what each product costs among its neighbours. Here each product's fastest
staged tile and fastest ``packed_gemv`` tile are chosen alone (every tile checked first, as the tuner
checks it), and then a layer's four products run in the step's order over 28 layers for all 16 ways
of taking one or the other, in turns, ``ROUNDS`` times; medians, µs a layer. The attention is not in
the chain. Writes ``$OUT/probe-chain-tiles.json`` with the load averages before and after.
"""
import itertools
import json
import os
import statistics

import torch
import triton

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels, staged
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.products import QWEN2_VL_2B, layer_calls, layer_case, right_one_row_tiles

LAYERS, GS = 28, 128


def main():
    dev = torch.device("cuda")
    rounds = int(os.environ.get("ROUNDS", "5"))
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "loadavg_before": os.getloadavg(), "products": {}}
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    calls = {}  # product -> {"staged" | "packed": the 28 layers' calls on its fastest tile of that kind}
    for name, n, k, kind in QWEN2_VL_2B:
        x, kw, ws, outs = layer_case(kind, n, k, dev, LAYERS, GS)
        tiles = td.PACKED_GEMV_CANDIDATES + tuple(staged.tiles_that_fit(ws[0], x.dtype, kw.get("glu", False)))
        kernels.compile_ahead([f for t in tiles for f in layer_calls(x, ws[:1], t, outs, space, warmup=True, **kw)])
        right, wrong = right_one_row_tiles(x, ws[0], tiles, outs[0], space, **kw)
        alone = {t: kernels.graph_time_us(layer_calls(x, ws, t, outs, space, **kw), 10) for t in right}
        entry = {"wrong": wrong, "alone_us": {td._config_name(t): round(v, 2) for t, v in alone.items()}}
        calls[name] = {}
        for kind_name, is_kind in (("staged", lambda t: isinstance(t, staged.StagedGemvConfig)),
                                   ("packed", lambda t: isinstance(t, td.PackedGemvConfig))):
            best = min((t for t in alone if is_kind(t)), key=alone.get)
            calls[name][kind_name] = layer_calls(x, ws, best, outs, space, **kw)
            entry[kind_name] = {"tile": td._config_name(best), "alone_us": round(alone[best], 2)}
        res["products"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k != "alone_us"}), flush=True)
    names = [p[0] for p in QWEN2_VL_2B]
    mixes = list(itertools.product(("packed", "staged"), repeat=len(names)))
    times = {m: [] for m in mixes}
    for _ in range(rounds):
        for m in mixes:
            per_product = [calls[name][kind] for name, kind in zip(names, m)]
            chain = [f for layer in zip(*per_product) for f in layer]  # a layer's products in order, layer by layer
            times[m].append(kernels.graph_time_us(chain, 10) * len(chain) / LAYERS)
    res["chain_us_a_layer"] = []
    for m in mixes:
        alone_sum = sum(res["products"][name][kind]["alone_us"] for name, kind in zip(names, m))
        med = statistics.median(times[m])
        res["chain_us_a_layer"].append({"tiles": dict(zip(names, m)), "median": round(med, 2),
                                        "runs": [round(t, 2) for t in times[m]], "alone_sum": round(alone_sum, 2),
                                        "chain_over_alone": round(med - alone_sum, 2)})
        print(" ".join(k[0] for k in m), round(med, 2), "alone", round(alone_sum, 2), flush=True)
    res["loadavg_after"] = os.getloadavg()
    with open(os.path.join(os.environ.get("OUT", "."), "probe-chain-tiles.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
