"""Diagnostic probe (not a benchmark): where the batch-1 step's tile descent ends, run again and
again in one process, with the descent as it is (``step_tuning.descend``: the fastest change of
a round, timed again before it is taken) and with the descent of another revision, read from git
(``--before``, by default 5fb1298's: the first change that helped, product by product, on one
timing). The two alternate; each run starts from the tiles chosen alone and has the engine's budget
(``runtime.step_tuning_s``). Then every set of tiles a run ended on is timed again, in turns,
``--retime`` times: what a descent's end is worth, free of the luck of its own last timing.

With ``--staged`` (and ``EDGEINFER_STAGED_PRODUCTS`` not ``0``, so that the tuner times the staged
products' tiles alone, :func:`edgeinfer.quant.staged.candidates`) the two that alternate are the
present descent over every tile and the same descent over the tiles without the staged ones, each
from the fastest alone of its own set: the step with the staged products against without, and
``median_us`` pools each one's ends as timed again.

    python scripts/probe_step_tuning.py --model DIR --runs 3 --out probe.json
    EDGEINFER_TILE_CACHE=off python scripts/probe_step_tuning.py --model DIR --staged --runs 2 --out probe.json

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
from edgeinfer.quant import staged
from edgeinfer.quant.launching import STAGED_ENV
from edgeinfer.quant.staged import StagedGemvConfig

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
    parser.add_argument("--staged", action="store_true",
                        help="the present descent over every tile against over the tiles without the staged ones")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.staged and not staged.enabled():
        parser.error(f"--staged needs the staged tiles, which {STAGED_ENV}=0 leaves out")
    config = EngineConfig(dtype="bfloat16", device="cuda", max_batch_size=1, block_size=16, kv_budget_mb=1024,
                          max_context=4096, cuda_graphs=True, prefix_cache=False, step_tuning_s=0.0)
    engine = Engine.load(args.model, config=config)
    fused = engine.decoder_engine._fused
    ranked = fused._tune_alone(NoSteps())
    if args.staged:  # label -> (descent, each product's tiles fastest first)
        variants = {"every tile": (step_tuning.descend, ranked),
                    "without staged": (step_tuning.descend, {name: [t for t in tiles if not isinstance(t, StagedGemvConfig)]
                                                             for name, tiles in ranked.items()})}
    else:
        variants = {"steepest, timed again": (step_tuning.descend, ranked),
                    f"as at {args.before}": (descend_at(args.before), ranked)}
    starts = {label: {name: tiles[0] for name, tiles in tiles_of.items()} for label, (_, tiles_of) in variants.items()}
    names_of = {label: {k: triton_decode._config_name(v) for k, v in start.items()} for label, start in starts.items()}
    out = {"model": str(args.model), "gpu": torch.cuda.get_device_name(), "load_before": os.getloadavg(),
           "alone": names_of, "runs": []}
    # every distinct set of tiles a run started or ended on, by names
    ends = {names_key(names_of[label]): start for label, start in starts.items()}
    kept = step_tuning.descend
    try:
        for run in range(args.runs):
            for label, (fn, tiles_of) in variants.items():
                fused.configs = dict(starts[label])
                triton_decode.descend = fn
                fused._tune_in_step(tiles_of, args.budget, NoSteps())
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
    alone_keys = {names_key(names) for names in names_of.values()}
    out["retimed"] = [{"ends": dict(key), "alone": key in alone_keys, "us": [round(t, 1) for t in ts],
                       "median_us": round(statistics.median(ts), 1)} for key, ts in times.items()]
    for r in out["runs"]:
        r["retimed_median_us"] = round(statistics.median(times[names_key(r["ends"])]), 1)
    # each descent's ends, every timing of them pooled (an end reached twice counts twice)
    pooled = {label: statistics.median([t for r in out["runs"] if r["descent"] == label
                                        for t in times[names_key(r["ends"])]]) for label in variants}
    out["median_us"] = {label: round(us, 1) for label, us in pooled.items()}
    first, second = pooled.values()
    out["second_over_first"] = round(second / first, 4)
    out["load_after"] = os.getloadavg()
    print_and_save(out, args.out)


if __name__ == "__main__":
    main()
