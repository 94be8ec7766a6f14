"""Diagnostic probe (not a benchmark): the integer-dot tiles with and without the next step's x asked of L1 a
step ahead (``EDGEINFER_X_PREFETCH``), on a GPU.

    OUT=folder ROUNDS=7 python scripts/probe_x_prefetch.py
    python scripts/probe_x_prefetch.py --check      # the same tiles under Triton's interpreter, no GPU

For 4-bit weights (random codes, groups of 128, symmetric, bf16 scales), each of a Qwen2-VL-2B layer's four
products fused as the step fuses it, over 28 copies of its weight, on the integer-dot tile an H100's step keeps
for it (``TILES``): each way is checked as the tuner checks a tile, then timed alone (28 calls from one CUDA
graph, as the tuner times a tile), the two ways in turns, ``ROUNDS`` times; then a layer's four products in
the step's order over 28 layers, the two ways in turns. Medians, µs a call (the chain: µs a layer). The
attention is not in the chain. Writes ``$OUT/probe-x-prefetch.json`` with the load averages before and after.
"""
import json
import os
import statistics

import torch
import triton

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels
from edgeinfer.quant.launching import X_PREFETCH_ENV, SplitWorkspace
from edgeinfer.testing.products import QWEN2_VL_2B, check_or_run, layer_calls, layer_case, right_one_row_tiles

LAYERS, GS = 28, 128
# The integer-dot tiles an H100's step kept for the 4-bit layers (docs/results/probes/h100-4-bit-head)
TILES = {"qkv": td.PackedGemvConfig(8, 2048, 4, 4, idot=True), "o": td.PackedGemvConfig(8, 2048, 4, 4, idot=True),
         "gate_up": td.PackedGemvConfig(32, 256, 4, idot=True), "down": td.PackedGemvConfig(16, 1024, 4, 8, idot=True)}
WAYS = {"read": "0", "prefetched": "1"}


def check(dev):
    """Each product's tile, both ways, against the tuner's check, under the interpreter, at a small shape."""
    found = {}
    space = SplitWorkspace(dev)
    for name, kind in (("qkv", "norm+bias"), ("gate_up", "norm+glu"), ("down", "residual")):
        x, kw, ws, outs = layer_case(kind, 64, 512, dev, 1, GS, 4)
        for way, value in WAYS.items():
            os.environ[X_PREFETCH_ENV] = value
            _, wrong = right_one_row_tiles(x, ws[0], [td.PackedGemvConfig(16, 256, 4, idot=True)], outs[0], space, **kw)
            found[f"{name} {way}"] = wrong or None
    return found


def timed(calls: list, way: str) -> float:
    """µs a call of ``calls`` from one graph, captured with the switch set as ``way`` says."""
    os.environ[X_PREFETCH_ENV] = WAYS[way]
    return kernels.graph_time_us(calls, 10)


def main(rounds):
    dev = torch.device("cuda")
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "rounds": rounds, "group": GS, "loadavg_before": os.getloadavg(), "products": {}}
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    out = os.path.join(os.environ.get("OUT", "."), "probe-x-prefetch.json")
    calls = {}
    for name, n, k, kind in QWEN2_VL_2B:
        x, kw, ws, outs = layer_case(kind, n, k, dev, LAYERS, GS, 4)
        tile = TILES[name]
        entry = {"tile": td._config_name(tile), "wrong": {}}
        for way, value in WAYS.items():
            os.environ[X_PREFETCH_ENV] = value
            _, wrong = right_one_row_tiles(x, ws[0], [tile], outs[0], space, **kw)
            entry["wrong"][way] = wrong or None
        calls[name] = layer_calls(x, ws, tile, outs, space, **kw)
        runs = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way in WAYS:
                runs[way].append(timed(calls[name], way))
        entry.update({way: {"median": round(statistics.median(v), 2), "runs": [round(t, 2) for t in v]}
                      for way, v in runs.items()})
        res["products"][name] = entry
        print(name, json.dumps(entry), flush=True)
        json.dump(res, open(out, "w"), indent=1)
    chain = [f for layer in zip(*(calls[name] for name, *_ in QWEN2_VL_2B)) for f in layer]
    runs = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            runs[way].append(timed(chain, way) * len(chain) / LAYERS)
    res["chain_us_a_layer"] = {way: {"median": round(statistics.median(v), 2), "runs": [round(t, 2) for t in v]}
                               for way, v in runs.items()}
    print("chain", json.dumps(res["chain_us_a_layer"]), flush=True)
    res["loadavg_after"] = os.getloadavg()
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    check_or_run(check, main)
