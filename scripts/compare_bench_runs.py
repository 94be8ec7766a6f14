#!/usr/bin/env python3
"""Put `edgeinfer bench gpu` raw files of several runs side by side, and pool each tree's runs.

    python scripts/compare_bench_runs.py OUT/*/gpu-*.json > OUT/compare.md

A file's tree is its folder's name less a trailing ``-<round>`` (``scripts/bench_trees.sh``
writes ``OUT/<tree>-<round>/``); files straight under one folder are one tree each. For every
tree, engine and batch size: each run's medians (decode only, whole request, first token; the
step the tuner timed, alone and in the step, where the engine reports it), then the medians of
all the tree's timed runs pooled, with their range, and each tree's pooled decode over the
first tree's. Medians of all runs, never the best; the load each run saw is in its raw file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from edgeinfer.bench.gpu import run_figures
from edgeinfer.bench.stats import Spread, ratio, spread

FIGURES = (("decode_tok_s", "decode (tok/s)", 1.0), ("request_tok_s", "whole request (tok/s)", 1.0),
           ("first_token_s", "first token (ms)", 1000.0))


def tree_of(path: Path) -> str:
    """The tree a raw file belongs to: its folder's name less a trailing ``-<round>``."""
    return re.sub(r"-\d+$", "", path.parent.name)


def timed_figures(report: dict, engine: str) -> dict[int, list[dict]]:
    """Per batch size, every timed run's figures of ``engine`` in one raw file."""
    new_tokens = report["spec"]["new_tokens"]
    out: dict[int, list[dict]] = defaultdict(list)
    for record in report["runs"].get(engine, []):
        if record.get("timed"):
            out[record["batch"]].append(run_figures(record, new_tokens))
    return out


def shown(s: Spread, scale: float) -> str:
    if not s.n:
        return "–"
    return f"{s.median * scale:,.1f} ({s.min * scale:,.1f}–{s.max * scale:,.1f})"


def step_of(report: dict, engine: str) -> str:
    step = report["results"].get(engine, {}).get("diagnostics", {}).get("kernels", {}).get("step")
    if not step:
        return "–"
    return f"{step['alone_us']:,.1f} → {step['in_step_us']:,.1f}"


def compare(paths: list[Path]) -> str:
    runs: dict[tuple[str, str, int], list[tuple[str, list[dict], str]]] = defaultdict(list)
    trees: list[str] = []
    for path in paths:
        report = json.loads(path.read_text())
        if report.get("benchmark") != "gpu":
            raise SystemExit(f"{path}: not an `edgeinfer bench gpu` raw file")
        tree = tree_of(path)
        trees += [tree] if tree not in trees else []
        for engine in report["runs"]:
            for batch, figures in timed_figures(report, engine).items():
                runs[(tree, engine, batch)].append((path.parent.name, figures, step_of(report, engine)))
    lines = ["| tree | engine | batch | run | " + " | ".join(label for _, label, _ in FIGURES)
             + " | step alone → in the step (µs) |", "|---" * (5 + len(FIGURES)) + "|"]
    pooled: dict[tuple[str, str, int], dict[str, Spread]] = {}
    for key in sorted(runs, key=lambda k: (k[1], k[2], trees.index(k[0]))):
        tree, engine, batch = key
        for run, figures, step in runs[key]:
            cells = [shown(spread(f[name] for f in figures), scale) for name, _, scale in FIGURES]
            lines.append(f"| {tree} | {engine} | {batch} | {run} | " + " | ".join(cells) + f" | {step} |")
        every = [f for _, figures, _ in runs[key] for f in figures]
        pooled[key] = {name: spread(f[name] for f in every) for name, _, _ in FIGURES}
        cells = [f"**{shown(pooled[key][name], scale)}**" for name, _, scale in FIGURES]
        lines.append(f"| {tree} | {engine} | {batch} | all {len(every)} timed runs | " + " | ".join(cells) + " | |")
    lines += ["", "| engine | batch | tree | pooled decode over the first tree's |", "|---|---|---|---|"]
    for (tree, engine, batch), figures in pooled.items():
        base = pooled.get((trees[0], engine, batch))
        if tree != trees[0] and base is not None:
            over = ratio(figures["decode_tok_s"].median, base["decode_tok_s"].median)
            lines.append(f"| {engine} | {batch} | {tree} | {over:.3f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="`edgeinfer bench gpu` raw JSON files")
    args = parser.parse_args(argv)
    sys.stdout.write(compare(args.files))


if __name__ == "__main__":
    main()
