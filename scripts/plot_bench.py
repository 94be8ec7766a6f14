#!/usr/bin/env python3
"""Plot tokens/s against batch size from `edgeinfer bench gpu` raw files (decode only and whole request).

    python scripts/plot_bench.py OUT/gpu-*.json --out OUT/decode-vs-batch.png

Needs matplotlib: `pip install -e .[plot]`. Medians with min-max bars; the roofline dashed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on a file backend, or an exit with the install command."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib, an optional extra: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series(report: dict, kind: str, key: str) -> tuple[list[int], list[float], list[list[float]]]:
    """Batch sizes, medians and [below, above] error bars of one engine's figure in a raw file."""
    rows = sorted((int(b), s[key]) for b, s in report["summary"][kind].items() if s[key]["n"])
    batches = [b for b, _ in rows]
    medians = [s["median"] for _, s in rows]
    bars = [[s["median"] - s["min"] for _, s in rows], [s["max"] - s["median"] for _, s in rows]]
    return batches, medians, bars


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(args.reports), figsize=(5.5 * len(args.reports), 4), squeeze=False)
    for ax, path in zip(axes[0], args.reports):
        report = json.loads(path.read_text())
        if report.get("benchmark") != "gpu":
            raise SystemExit(f"{path} is not a raw file of `edgeinfer bench gpu`")
        for i, kind in enumerate(report["summary"]):
            color = f"C{i}"
            for key, style, label in (("decode_tok_s", "-", "decode"), ("request_tok_s", ":", "request")):
                batches, medians, bars = series(report, kind, key)
                ax.errorbar(batches, medians, yerr=bars, linestyle=style, marker="o", color=color, capsize=3,
                            label=f"{kind} ({label})")
        roof = report.get("roofline") or {}
        if roof:
            points = sorted((int(b), v["roofline_tok_s"]) for b, v in roof.items())
            ax.plot(*zip(*points), linestyle="--", color="grey", label="bandwidth roofline")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s",
               title=f"{path.stem.removeprefix('gpu-')} on {report['environment'].get('gpu', 'CPU')}")
        sizes = report["spec"]["batch_sizes"]
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        if not report.get("publishable", False):
            ax.text(0.5, 0.5, "not publishable", transform=ax.transAxes, ha="center", alpha=0.3, fontsize=20)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    sys.exit(main())
