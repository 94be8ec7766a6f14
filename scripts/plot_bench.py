#!/usr/bin/env python3
"""Plot `edgeinfer bench gpu` and `edgeinfer bench serve` raw files.

    python scripts/plot_bench.py OUT/gpu-*.json --out OUT/decode-vs-batch.png
    python scripts/plot_bench.py OUT/serve-*.json --out OUT/open-loop.png

A gpu file: tokens/s against batch size (decode only and whole request), medians with
min-max bars, the roofline dashed. Serve files, all on one figure: the open loop's
throughput and first token p50 / p99 against the arrival rate, one line per file.
Needs matplotlib: `pip install -e .[plot]`.
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


def serve_label(report: dict) -> str:
    """What set one serve run apart: its profile, the overrides it ran with and the concurrency they gave."""
    spec, limits = report["spec"], report["limits"]
    overrides = [o for o in spec.get("overrides", ()) if o.startswith("runtime.max_batch_size")]
    return (f"{spec['profile']} {' '.join(overrides) or 'as shipped'} ({limits['max_concurrent']} at once), "
            f"run {report['created'][:16].replace('T', ' ')}")


def plot_serve(plt, reports: list[tuple[Path, dict]]):
    """Open-loop throughput and first-token p50 / p99 against the arrival rate."""
    fig, (rate_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4 + 0.3 * len(reports)))
    for i, (path, report) in enumerate(reports):
        rows = sorted((r["rate"], r["summary"]) for r in report.get("open_loop", []))
        if not rows:
            raise SystemExit(f"{path} has no open-loop part")
        rates = [rate for rate, _ in rows]
        label = serve_label(report)
        rate_ax.plot(rates, [s["tokens_per_s"] for _, s in rows], marker="o", color=f"C{i}", label=label)
        ttft_ax.plot(rates, [s["ttft_p50_s"] * 1e3 for _, s in rows], marker="o", color=f"C{i}", label=f"{label} p50")
        ttft_ax.plot(rates, [s["ttft_p99_s"] * 1e3 for _, s in rows], marker="^", linestyle=":", color=f"C{i}",
                     label=f"{label} p99")
    gpu = reports[0][1]["environment"].get("gpu", "CPU")
    rate_ax.set(xlabel="arrivals / s (Poisson)", ylabel="tokens/s, whole requests", title=f"open loop on {gpu}")
    ttft_ax.set(xlabel="arrivals / s (Poisson)", ylabel="first token (ms)", yscale="log", title="first token")
    for ax in (rate_ax, ttft_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))  # below: the lines fill the axes
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    plt = pyplot()
    loaded = [(path, json.loads(path.read_text())) for path in args.reports]
    kinds = {report.get("benchmark") for _, report in loaded}
    if kinds == {"serve"}:
        fig = plot_serve(plt, loaded)
    elif kinds == {"gpu"}:
        fig = plot_gpu(plt, loaded)
    else:
        raise SystemExit(f"give raw files of `edgeinfer bench gpu` or of `edgeinfer bench serve`, one kind at a time; "
                         f"got {sorted(map(str, kinds))}")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(args.out)


def plot_gpu(plt, reports: list[tuple[Path, dict]]):
    """Tokens/s against batch size, one panel per file."""
    fig, axes = plt.subplots(1, len(reports), figsize=(5.5 * len(reports), 4), squeeze=False)
    for ax, (path, report) in zip(axes[0], reports):
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
        ax.tick_params(axis="x", which="minor", labelbottom=False)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        if not report.get("publishable", False):
            ax.text(0.5, 0.5, "not publishable", transform=ax.transAxes, ha="center", alpha=0.3, fontsize=20)
    return fig


if __name__ == "__main__":
    sys.exit(main())
