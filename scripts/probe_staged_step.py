"""Diagnostic probe (not a benchmark): the batch-1 step with the staged products against without,
in one process, on the tuner's own step timing.

The model loads with ``EDGEINFER_STAGED_PRODUCTS=1``, so the tuner times every tile alone, the
staged ones among them (:func:`edgeinfer.quant.staged.candidates`). Two descents follow
(``step_tuning.descend``, the engine's budget), in turns ``--runs`` times: one over every
product's fastest tiles, one over the tiles without the staged ones, each from the fastest alone of
its own set. Then every set of tiles a descent ended on is timed again, in turns, ``--retime``
times (a batch-1 step over a past of ``step_tuning.STEP_TUNING_CONTEXT`` positions, from a CUDA
graph as the engine replays it): the medians compare the step with and without the staged tiles.

    EDGEINFER_STAGED_PRODUCTS=1 EDGEINFER_TILE_CACHE=off \\
        python scripts/probe_staged_step.py --model DIR --out probe.json

The model is a 4-bit checkpoint the fused step runs (``edgeinfer bench gpu --weights w4a16-h8``
writes one into its cache). One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from edgeinfer.backends.torch import step_tuning, triton_decode
from edgeinfer.bench.raw import print_and_save
from edgeinfer.engine import Engine, EngineConfig
from edgeinfer.progress import NoSteps
from edgeinfer.quant import staged
from edgeinfer.quant.staged import StagedGemvConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=2, help="descents of each set of tiles")
    parser.add_argument("--retime", type=int, default=5, help="timings of each end, in turns")
    parser.add_argument("--budget", type=float, default=8.0, help="seconds a descent (the engine's default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not staged.enabled():
        parser.error(f"set {staged.STAGED_ENV}=1: the staged tiles are timed only with it")
    config = EngineConfig(dtype="bfloat16", device="cuda", max_batch_size=1, block_size=16, kv_budget_mb=1024,
                          max_context=4096, cuda_graphs=True, prefix_cache=False, step_tuning_s=0.0)
    engine = Engine.load(args.model, config=config)
    fused = engine.decoder_engine._fused
    ranked = fused._tune_alone(NoSteps())
    sets = {"with staged": ranked,
            "without staged": {name: [t for t in tiles if not isinstance(t, StagedGemvConfig)]
                               for name, tiles in ranked.items()}}
    out = {"model": str(args.model), "gpu": torch.cuda.get_device_name(), "load_before": os.getloadavg(),
           "alone": {name: {triton_decode._config_name(t): fused.report[name]["candidates_us"][triton_decode._config_name(t)]
                            for t in tiles[:4]} for name, tiles in ranked.items()}, "runs": []}
    ends: dict[str, list[dict]] = {label: [] for label in sets}
    for run in range(args.runs):
        for label, tiles in sets.items():
            fused.configs = {name: ts[0] for name, ts in tiles.items()}
            fused._tune_in_step(tiles, args.budget, NoSteps())
            ends[label].append(dict(fused.configs))
            names = {k: triton_decode._config_name(v) for k, v in fused.configs.items()}
            out["runs"].append({"tiles": label, "run": run, "report": fused.step_report, "ends": names})
            print(out["runs"][-1], flush=True)
    step = fused._scratch_step(step_tuning.STEP_TUNING_CONTEXT)
    times: dict[tuple[str, int], list[float]] = {(label, i): [] for label in sets for i in range(args.runs)}
    for _ in range(args.retime):
        for (label, i) in times:
            fused.configs = dict(ends[label][i])
            times[(label, i)].append(step_tuning.step_time_us(step))
    out["retimed"] = [{"tiles": label, "run": i, "us": [round(t, 1) for t in ts], "median_us": round(statistics.median(ts), 1)}
                      for (label, i), ts in times.items()]
    pooled = {label: statistics.median([t for (lab, _), ts in times.items() if lab == label for t in ts]) for label in sets}
    out["median_us"] = {label: round(us, 1) for label, us in pooled.items()}
    out["with_over_without"] = round(pooled["with staged"] / pooled["without staged"], 4)
    out["load_after"] = os.getloadavg()
    print_and_save(out, args.out)


if __name__ == "__main__":
    main()
