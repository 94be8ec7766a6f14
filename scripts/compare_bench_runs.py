#!/usr/bin/env python3
"""Put `edgeinfer bench gpu` raw files of several runs side by side, and pool each tree's runs.

    python scripts/compare_bench_runs.py OUT/*/gpu-*.json > OUT/compare.md

A file's tree is its folder's name less a trailing ``-<round>`` (``scripts/bench_trees.sh``
writes ``OUT/<tree>-<round>/``); files straight under one folder are one tree each. For every
tree, engine and batch size: each run's medians (decode only, decode in the call, whole
request, first token; the step the tuner timed, alone and in the step, where the engine reports
it), then the medians of all the tree's timed runs pooled, with their range, and each tree's
pooled decode (both spans: a full call less a one-token call, and the full call after its own
first tokens) over the first tree's. Medians of all runs, never the best; the load each run saw is in its raw file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

from edgeinfer.bench.gpu import summarize
from edgeinfer.bench.stats import Spread, ratio

FIGURES = (("decode_tok_s", "decode (tok/s)", 1.0), ("decode_in_call_tok_s", "decode in the call (tok/s)", 1.0),
           ("request_tok_s", "whole request (tok/s)", 1.0), ("first_token_s", "first token (ms)", 1000.0))


def tree_of(path: Path) -> str:
    """The tree a raw file belongs to: its folder's name less a trailing ``-<round>``."""
    return re.sub(r"-\d+$", "", path.parent.name)


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
    # (tree, engine) -> [(run, its records, its step)]; the tree's records pooled go through the
    # benchmark's own summary, as one invocation's would
    runs: dict[tuple[str, str], list[tuple[str, list[dict], str]]] = defaultdict(list)
    trees: list[str] = []
    new_tokens = set()
    for path in paths:
        report = json.loads(path.read_text())
        if report.get("benchmark") != "gpu":
            raise SystemExit(f"{path}: not an `edgeinfer bench gpu` raw file")
        new_tokens.add(report["spec"]["new_tokens"])
        tree = tree_of(path)
        trees += [tree] if tree not in trees else []
        for engine, records in report["runs"].items():
            runs[(tree, engine)].append((path.parent.name, records, step_of(report, engine)))
    if len(new_tokens) != 1:
        raise SystemExit(f"the runs generated different token counts ({sorted(new_tokens)}): not like for like")
    n = new_tokens.pop()
    lines = ["| tree | engine | batch | run | " + " | ".join(label for _, label, _ in FIGURES)
             + " | step alone → in the step (µs) |", "|---" * (5 + len(FIGURES)) + "|"]
    pooled: dict[tuple[str, str, int], dict[str, Spread]] = {}
    for tree, engine in sorted(runs, key=lambda k: (k[1], trees.index(k[0]))):
        each = [(run, summarize(records, n), step) for run, records, step in runs[(tree, engine)]]
        everything = summarize([r for _, records, _ in runs[(tree, engine)] for r in records], n)
        for batch, figures in everything.items():
            for run, summary, step in each:
                if batch in summary:
                    cells = [shown(summary[batch][name], scale) for name, _, scale in FIGURES]
                    lines.append(f"| {tree} | {engine} | {batch} | {run} | " + " | ".join(cells) + f" | {step} |")
            pooled[(tree, engine, batch)] = figures
            cells = [f"**{shown(figures[name], scale)}**" for name, _, scale in FIGURES]
            timed = figures[FIGURES[0][0]].n
            lines.append(f"| {tree} | {engine} | {batch} | all {timed} timed runs | " + " | ".join(cells) + " | |")
    lines += ["", "| engine | batch | tree | pooled decode over the first tree's | the same, decode in the call |",
              "|---|---|---|---|---|"]
    for (tree, engine, batch), figures in pooled.items():
        base = pooled.get((trees[0], engine, batch))
        if tree != trees[0] and base is not None:
            over = [ratio(figures[key].median, base[key].median) for key in ("decode_tok_s", "decode_in_call_tok_s")]
            lines.append(f"| {engine} | {batch} | {tree} | "
                         + " | ".join(f"{o:.3f}×" if math.isfinite(o) else "–" for o in over) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="`edgeinfer bench gpu` raw JSON files")
    args = parser.parse_args(argv)
    sys.stdout.write(compare(args.files))


if __name__ == "__main__":
    main()
