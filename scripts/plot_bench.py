"""Plot decode tokens/s against batch size from `edgeinfer bench gpu` JSON reports.

    python scripts/plot_bench.py docs/results/gpu-*.json --out docs/results/decode-vs-batch.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    fig, axes = plt.subplots(1, len(args.reports), figsize=(5.5 * len(args.reports), 4), squeeze=False)
    for ax, path in zip(axes[0], args.reports):
        report = json.loads(path.read_text())
        for kind, result in report["results"].items():
            points = sorted((int(b), rate) for b, rate in result["decode_tok_s"].items())
            ax.plot(*zip(*points), marker="o", label=kind)
        roof = report.get("roofline", {})
        if roof:
            points = sorted((int(b), v["roofline_tok_s"]) for b, v in roof.items())
            ax.plot(*zip(*points), linestyle="--", color="grey", label="bandwidth roofline")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s",
               title=f"{path.stem.removeprefix('gpu-')} on {report['environment'].get('gpu', 'CPU')}")
        ax.set_xticks([int(b) for b in report["spec"]["batch_sizes"]], [str(b) for b in report["spec"]["batch_sizes"]])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
