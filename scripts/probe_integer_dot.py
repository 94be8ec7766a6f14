"""Diagnostic probe (not a benchmark): the batch-1 packed product with x's columns as 16-bit integers dotted
with the codes by ``dp2a`` (``PackedGemvConfig.idot``) beside the same tiles in float32, on a GPU.

    OUT=folder ROUNDS=5 python scripts/probe_integer_dot.py
    OUT=folder BITS=8 GROUP=row python scripts/probe_integer_dot.py   # 8-bit layers, one scale a row
    python scripts/probe_integer_dot.py --check      # the same tiles under Triton's interpreter, no GPU

For 4-bit and 8-bit weights (random codes, groups of 128 or with ``GROUP=row`` one scale a row, symmetric,
bf16 scales), each of a Qwen2-VL-2B
layer's four products fused as the step fuses it, over 28 copies of its weight: every tile of
``PACKED_GEMV_CANDIDATES`` and its integer-dot twin is checked as the tuner checks a tile, then timed alone
(28 calls from one CUDA graph, as the tuner times a tile) ``ROUNDS`` times in turns; medians, µs a call. Then a
layer's four products in the step's order over 28 layers on each kind's fastest tiles, in turns, µs a layer.
The attention is not in the chain. Writes ``$OUT/probe-integer-dot.json`` with the load averages before and after.

    OUT=folder ROUNDS=5 python scripts/probe_integer_dot.py --head

times the int8 ``lm_head`` instead (151,936 × 1,536, one scale a row, behind the final RMSNorm, as the
``-h8`` checkpoints carry it; two copies, since one is far larger than L2): every tile and its twin, no chain.
"""
import dataclasses
import json
import os
import statistics
import sys

import torch
import triton

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.products import QWEN2_VL_2B, layer_calls, layer_case, right_one_row_tiles

LAYERS, GS = 28, 128
HEAD = ("lm_head", 151936, 1536, "norm")  # Qwen2-VL-2B's head at batch 1, one scale a row


def twins(tiles):
    return [t for tile in tiles for t in (tile, dataclasses.replace(tile, idot=True))]


def check(dev):
    """Every twin of a few tiles against the tuner's check, under the interpreter, at a small shape."""
    found = {}
    space = SplitWorkspace(dev)
    for bits in (4, 8):
        for name, kind in (("qkv", "norm+bias"), ("gate_up", "norm+glu"), ("down", "residual")):
            x, kw, ws, outs = layer_case(kind, 64, 512, dev, 1, GS, bits)
            tiles = twins([td.PackedGemvConfig(16, 256, 4), td.PackedGemvConfig(8, 128, 2, 2)])
            right, wrong = right_one_row_tiles(x, ws[0], tiles, outs[0], space, **kw)
            found[f"w{bits} {name}"] = wrong or None
    x, kw, ws, outs = layer_case("norm", 64, 512, dev, 1, 512, 8)  # the int8 head's kind: one scale a row
    right, wrong = right_one_row_tiles(x, ws[0], twins([td.PackedGemvConfig(16, 256, 4)]), outs[0], space, **kw)
    found["w8 head"] = wrong or None
    return found


def timed_twins(x, kw, ws, outs, space, rounds):
    """Every tile of ``PACKED_GEMV_CANDIDATES`` and its twin over the copies ``ws``: checked as the tuner checks a
    tile, the right ones timed ``rounds`` times in turns. The timings a tile, and the wrong tiles."""
    tiles = twins(td.PACKED_GEMV_CANDIDATES)
    kernels.compile_ahead([f for t in tiles for f in layer_calls(x, ws[:1], t, outs, space, warmup=True, **kw)])
    right, wrong = right_one_row_tiles(x, ws[0], tiles, outs[0], space, **kw)
    times = {t: [] for t in right}
    for _ in range(rounds):
        for t in right:
            times[t].append(kernels.graph_time_us(layer_calls(x, ws, t, outs, space, **kw), 10))
    return times, wrong


def ranked(times, wrong):
    """Each tile's median; the fastest float and integer-dot tiles (``{"float": tile, "idot": tile}``); and the
    record's entry: the wrong tiles, every median fastest first, and those two."""
    med = {t: statistics.median(v) for t, v in times.items()}
    picks = {label: min((t for t in med if t.idot == idot), key=med.get)
             for label, idot in (("float", False), ("idot", True))}
    entry = {"wrong": wrong, "us": {td._config_name(t): round(v, 2) for t, v in sorted(med.items(), key=lambda kv: kv[1])}}
    entry.update({label: {"tile": td._config_name(t), "us": round(med[t], 2)} for label, t in picks.items()})
    return med, picks, entry


def head(rounds):
    """The int8 head's tiles and their twins, each checked and then timed alone over two copies."""
    dev = torch.device("cuda")
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "copies": 2, "rounds": rounds, "loadavg_before": os.getloadavg(), "products": {}}
    torch.manual_seed(0)
    out = os.path.join(os.environ.get("OUT", "."), "probe-integer-dot-head.json")
    name, n, k, kind = HEAD
    x, kw, ws, outs = layer_case(kind, n, k, dev, 2, k, 8)
    times, wrong = timed_twins(x, kw, ws, outs, SplitWorkspace(dev), rounds)
    med, picks, entry = ranked(times, wrong)
    entry["runs"] = {td._config_name(t): [round(v, 2) for v in runs] for t, runs in times.items()}
    for label, t in picks.items():
        entry[label]["gb_s"] = round(ws[0].codes.numel() * 4 / med[t] / 1e3, 1)
    res["products"][f"w8 {name}"] = entry
    print("w8", name, json.dumps({k: v for k, v in entry.items() if k not in ("us", "runs")}), flush=True)
    res["loadavg_after"] = os.getloadavg()
    json.dump(res, open(out, "w"), indent=1)


def main(rounds):
    dev = torch.device("cuda")
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "layers": LAYERS, "rounds": rounds, "loadavg_before": os.getloadavg(), "products": {}}
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    out = os.path.join(os.environ.get("OUT", "."), "probe-integer-dot.json")
    row = os.environ.get("GROUP") == "row"  # one scale a row, as a W8A16 checkpoint's layers carry it
    res["group"] = "row" if row else GS
    for bits in map(int, os.environ.get("BITS", "4,8").split(",")):
        best = {}
        for name, n, k, kind in QWEN2_VL_2B:
            x, kw, ws, outs = layer_case(kind, n, k, dev, LAYERS, k if row else GS, bits)
            times, wrong = timed_twins(x, kw, ws, outs, space, rounds)
            _, picks, entry = ranked(times, wrong)
            best[name] = {label: layer_calls(x, ws, t, outs, space, **kw) for label, t in picks.items()}
            res["products"][f"w{bits} {name}"] = entry
            print(f"w{bits}", name, json.dumps({k: v for k, v in entry.items() if k != "us"}), flush=True)
            json.dump(res, open(out, "w"), indent=1)
        chains = {label: [f for layer in zip(*(best[name][label] for name, *_ in QWEN2_VL_2B)) for f in layer]
                  for label in ("float", "idot")}
        runs = {label: [] for label in chains}
        for _ in range(rounds):
            for label, chain in chains.items():
                runs[label].append(kernels.graph_time_us(chain, 10) * len(chain) / LAYERS)
        res[f"w{bits} chain_us_a_layer"] = {label: {"median": round(statistics.median(v), 2),
                                                    "runs": [round(t, 2) for t in v]} for label, v in runs.items()}
        print(f"w{bits} chain", json.dumps(res[f"w{bits} chain_us_a_layer"]), flush=True)
        del best, chains
        torch.cuda.empty_cache()
    res["loadavg_after"] = os.getloadavg()
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    if "--check" in sys.argv:
        found = check(torch.device("cpu"))
        print(json.dumps(found, indent=1))
        sys.exit(1 if any(v is not None for v in found.values()) else 0)
    (head if "--head" in sys.argv else main)(int(os.environ.get("ROUNDS", "5")))
