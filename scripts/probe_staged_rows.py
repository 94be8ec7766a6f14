"""Diagnostic probe (not a benchmark): the staged product at 2 to 16 rows (``staged.staged_mm``)
against the few-row product the layers use now (``kernels.packed_mm`` with the tile its tuner
chooses), on random 4-bit weights of Qwen2-VL-2B's shapes, bf16, groups of 128.

Each staged tile is first checked against torch as the tuner checks its tiles
(``kernels.checked_tiles``); a wrong one, or one this Triton refuses, is reported (``wrong``) and
not timed. Each product is timed as the tuner times it: over copies of the weight that do not fit
L2 together (``kernels.cold_copies``), replayed from one CUDA graph, µs a call. Every timing
``--rounds`` times, in turns; medians.

    OUT=probe.json python scripts/probe_staged_rows.py --rows 4,8,16 --rounds 3 --shapes gate_up,down

``--fused`` times the staged tiles only, each with what the decode step's few-row layers fuse into
that product (q|k|v: each row's RMSNorm and the bias; o and ``down``: the residual; gate|up: RMSNorm
and SiLU·up), as ``edgeinfer.testing.products.fused_inputs`` draws them. Those outputs are not
checked here (``tests/test_quant_staged.py`` checks them against torch); a tile the kernel refuses is
named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from edgeinfer.quant import kernels, staged
from edgeinfer.quant.kernels import checked_outputs, checked_tiles, cold_copies, graph_time_us
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.quant.packed import PackedMatrix
from edgeinfer.testing.products import fused_inputs, random_packed

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
FUSED = {"qkv": "norm+bias", "o": "residual", "gate_up": "norm+glu", "down": "residual"}  # as the step fuses them


def medians_in_turns(calls: dict, rounds: int) -> dict[str, float]:
    """µs a call of each of ``calls`` (label: a call per copy of the weight), timed ``rounds`` times in
    turns; medians."""
    times = {label: [] for label in calls}
    for _ in range(rounds):
        for label, fns in calls.items():
            times[label].append(graph_time_us(fns))
    return {label: round(statistics.median(ts), 2) for label, ts in times.items()}


def fused_times(name: str, w, copies, rows: int, rounds: int, space) -> dict:
    """µs a call of each staged tile that takes ``name``'s product with the step's fusions (medians of
    ``rounds``, in turns), and the tiles refused."""
    n, k = SHAPES[name]
    x, kw = fused_inputs(FUSED[name], n, k, w.codes.device, rows=rows)
    refused, calls = {}, {}
    for t in staged.tiles_that_fit(w, torch.bfloat16, bool(kw.get("glu"))):
        try:
            staged.staged_mm(x, w, t, workspace=space, **kw)
        except Exception as e:  # Gluon is experimental: a Triton that refuses the kernel
            refused[str(t)] = kernels.refusal(e)
            continue
        calls[f"staged {t.warps}w split{t.split}"] = [lambda c=c, t=t: staged.staged_mm(x, c, t, workspace=space, **kw)
                                                      for c in copies]
    us = medians_in_turns(calls, rounds)
    best = min(us, key=us.get, default=None)
    return {"mb": round(w.nbytes / 1e6, 2), "fused": FUSED[name], "us": us, "best_staged": best, "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"))
    parser.add_argument("--fused", action="store_true", help="the staged tiles alone, with the step's fusions")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    out = {"gpu": torch.cuda.get_device_name(), "load_before": os.getloadavg(), "fused": args.fused, "products": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = random_packed(n, k, 4, 128, dev)
        copies = [w] + [PackedMatrix(w.codes.clone(), w.scales.clone(), None, 4, 128, (n, k))
                        for _ in range(cold_copies(w.nbytes, l2) - 1)]
        tiles = staged.tiles_that_fit(w, torch.bfloat16, False)  # what the few-row tuner times
        outputs = checked_outputs(n)
        for rows in map(int, args.rows.split(",")):
            if args.fused:
                row = fused_times(name, w, copies, rows, args.rounds, space)
                out["products"].setdefault(name, {})[rows] = row
                print(name, rows, row["best_staged"], row["us"].get(row["best_staged"]), flush=True)
                continue
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            want = kernels.reference_outputs(x, w.codes, w.scales, None, w.layout, outputs)
            # a tile this Triton refuses is in ``wrong`` too, named (``checked_tiles``)
            right, wrong = checked_tiles(tiles, lambda t: staged.staged_mm(x, w, t, workspace=space), want, outputs)
            mm_tile = kernels.tuned_config(x, w.codes, w.scales, None, w.layout)
            calls = {"packed_mm " + kernels._tile_name(mm_tile): [lambda c=c: c.matmul(x) for c in copies]}
            calls |= {f"staged {t.warps}w split{t.split}": [lambda c=c, t=t: staged.staged_mm(x, c, t, workspace=space)
                                                         for c in copies] for t in right}
            us = medians_in_turns(calls, args.rounds)
            best = min((label for label in us if label.startswith("staged")), key=us.get, default=None)
            mm = next(iter(us))
            row = {"mb": round(w.nbytes / 1e6, 2), "us": us, "packed_mm": mm, "best_staged": best,
                   "staged_over_packed_mm": round(us[best] / us[mm], 3) if best else None,
                   "wrong": {str(t): why for t, why in wrong.items()}}
            out["products"].setdefault(name, {})[rows] = row
            print(name, rows, mm, us[mm], best, us.get(best), flush=True)
    out["load_after"] = os.getloadavg()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
