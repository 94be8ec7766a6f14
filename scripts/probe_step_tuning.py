"""Diagnostic probe (not a benchmark): where the batch-1 step's tile descent ends, run again and
again in one process, with the descent as it is (``step_tuning.descend``: the fastest change of
a round, timed again before it is taken) and with the descent of another revision, read from git
(``--before``, by default 5fb1298's: the first change that helped, product by product, on one
timing). The two alternate; each run starts from the tiles chosen alone and has the engine's budget
(``runtime.step_tuning_s``). Then every set of tiles a run ended on is timed again, in turns,
``--retime`` times: what a descent's end is worth, free of the luck of its own last timing.

    python scripts/probe_step_tuning.py --model DIR --runs 3 --out probe.json

The model is a checkpoint the fused step runs (the H200 runs use the 4-bit checkpoint that
``edgeinfer bench gpu --weights w4a16-h8`` writes into its cache). One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import torch

from edgeinfer.backends.torch import step_tuning, triton_decode
from edgeinfer.bench.raw import print_and_save
from edgeinfer.engine import Engine, EngineConfig
from edgeinfer.progress import NoSteps

ROOT = Path(__file__).resolve().parents[1]


def descend_at(rev: str):
    """``step_tuning.descend`` as it was at revision ``rev`` of this repository (read with git), so
    that the comparison runs that code itself; its result gets the ``refuted`` count the engine's
    report now reads (zero: it timed nothing again)."""
    source = subprocess.run(["git", "show", f"{rev}:edgeinfer/backends/torch/step_tuning.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"step_tuning_at_{rev}")
    sys.modules[module.__name__] = module  # its dataclass looks its module up there
    exec(compile(source, f"{rev}:edgeinfer/backends/torch/step_tuning.py", "exec"), module.__dict__)

    def descend(*args, **kwargs):
        found = module.descend(*args, **kwargs)
        found.refuted = getattr(found, "refuted", 0)
        return found

    return descend


def names_key(names: dict[str, str]) -> tuple:
    """A set of tiles (product -> tile name) as a key."""
    return tuple(sorted(names.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3, help="runs of each descent")
    parser.add_argument("--retime", type=int, default=5, help="timings of each end, in turns")
    parser.add_argument("--budget", type=float, default=8.0, help="seconds a descent (the engine's default)")
    parser.add_argument("--before", default="5fb1298",
                        help="the revision whose descent runs beside this one's (default: the first-change descent)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = EngineConfig(dtype="bfloat16", device="cuda", max_batch_size=1, block_size=16, kv_budget_mb=1024,
                          max_context=4096, cuda_graphs=True, prefix_cache=False, step_tuning_s=0.0)
    engine = Engine.load(args.model, config=config)
    fused = engine.decoder_engine._fused
    ranked = fused._tune_alone(NoSteps())
    alone = dict(fused.configs)
    out = {"model": str(args.model), "gpu": torch.cuda.get_device_name(), "load_before": os.getloadavg(),
           "alone": {k: triton_decode._config_name(v) for k, v in alone.items()}, "runs": []}
    variants = {"steepest, timed again": step_tuning.descend, f"as at {args.before}": descend_at(args.before)}
    ends = {names_key(out["alone"]): alone}  # every distinct set of tiles a run ended on, by names
    kept = step_tuning.descend
    try:
        for run in range(args.runs):
            for label, fn in variants.items():
                fused.configs = dict(alone)
                triton_decode.descend = fn
                fused._tune_in_step(ranked, args.budget, NoSteps())
                names = {k: triton_decode._config_name(v) for k, v in fused.configs.items()}
                ends.setdefault(names_key(names), dict(fused.configs))
                out["runs"].append({"descent": label, "run": run, "report": fused.step_report, "ends": names})
                print(json.dumps(out["runs"][-1]), flush=True)
    finally:
        triton_decode.descend = kept
    # each end, and the tiles chosen alone, timed again in turns
    step = fused._scratch_step(step_tuning.STEP_TUNING_CONTEXT)
    times: dict[tuple, list[float]] = {key: [] for key in ends}
    for _ in range(args.retime):
        for key, configs in ends.items():
            fused.configs = dict(configs)
            times[key].append(step_tuning.step_time_us(step))
    out["retimed"] = [{"ends": dict(key), "alone": key == names_key(out["alone"]), "us": [round(t, 1) for t in ts],
                       "median_us": round(statistics.median(ts), 1)} for key, ts in times.items()]
    for r in out["runs"]:
        r["retimed_median_us"] = round(statistics.median(times[names_key(r["ends"])]), 1)
    out["load_after"] = os.getloadavg()
    print_and_save(out, args.out)


if __name__ == "__main__":
    main()
