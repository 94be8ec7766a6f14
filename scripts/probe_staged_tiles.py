"""Diagnostic probe (not a benchmark): every staged tile (``edgeinfer.quant.staged``) of Qwen2-VL-2B's
four 4-bit products at one row, on a GPU, as the decode step calls each product (q|k|v with
RMSNorm and bias, o and ``down`` with the residual, gate|up with RMSNorm and SiLU·up).

    OUT=folder TAG=name ROUNDS=3 python scripts/probe_staged_tiles.py

Each tile is first checked as the tuner checks it (``triton_decode.right_tiles``: torch's product
at the outputs ``kernels.checked_outputs`` names); a tile outside the check is named and not timed.
Each is then timed as the tuner times a product: 28 weight copies (one a layer, so reads come from
memory), replayed from one CUDA graph (``kernels.graph_time_us``), µs a call, every tile ROUNDS
times in turns, medians. To compare two versions of the kernel, run it from each tree in its own
process (``PYTHONPATH`` naming the tree), one after the other, on one GPU. ``CHECK=0`` times every
tile unchecked, for a copy of the kernel altered to time a floor (its outputs wrong by design). Writes
``$OUT/probe-staged-tiles-$TAG.json`` with the load averages before and after.
"""
import json
import os
import statistics
import time

import torch
import triton

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels, staged
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.products import QWEN2_VL_2B, layer_calls, layer_case, right_one_row_tiles

LAYERS, GS = 28, 128


def main():
    dev = torch.device("cuda")
    rounds = int(os.environ.get("ROUNDS", "3"))
    res = {"tag": os.environ.get("TAG", ""), "torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name(), "layers": LAYERS, "loadavg_before": os.getloadavg(), "products": {}}
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    t0 = time.time()
    for name, n, k, kind in QWEN2_VL_2B:
        x, kw, ws, outs = layer_case(kind, n, k, dev, LAYERS, GS)
        tiles = staged.tiles_that_fit(ws[0], x.dtype, kw.get("glu", False))
        kernels.compile_ahead([f for t in tiles for f in layer_calls(x, ws[:1], t, outs, space, warmup=True, **kw)])
        if os.environ.get("CHECK", "1") == "0":  # a kernel altered to time a floor: wrong outputs by design
            right, wrong = tiles, {}
        else:
            right, wrong = right_one_row_tiles(x, ws[0], tiles, outs[0], space, **kw)
        times = {t: [] for t in right}
        for _ in range(rounds):
            for t in right:
                times[t].append(kernels.graph_time_us(layer_calls(x, ws, t, outs, space, **kw), 10))
        named = {td._config_name(t): v for t, v in times.items()}
        med = {t: round(statistics.median(v), 2) for t, v in named.items()}
        best = min(med, key=med.get) if med else None
        res["products"][name] = {"us": med, "runs": {t: [round(u, 2) for u in v] for t, v in named.items()},
                                 "wrong": wrong, "best": best, "best_us": med.get(best)}
        print(name, best, med.get(best), "wrong:", len(wrong), flush=True)
        del ws
    res["seconds"] = round(time.time() - t0, 1)
    res["loadavg_after"] = os.getloadavg()
    path = os.path.join(os.environ.get("OUT", "."), f"probe-staged-tiles-{res['tag']}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
