"""Benchmark ours against transformers' generate() on a SmolVLM-256M-shaped random checkpoint.

    python scripts/bench_generate.py --out bench-results/

Builds the checkpoint (random weights, real shapes) once under --cache, then runs both
engines in separate processes and writes report.json and report.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgeinfer.bench.generate import BenchSpec, compare, markdown
from edgeinfer.testing.checkpoints import make_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgeinfer" / "bench")
    parser.add_argument("--size", default="smolvlm-256m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = args.cache / f"smolvlm-{args.size}"
    if not (model / "model.safetensors").is_file():
        make_checkpoint("smolvlm", model, size=args.size)
    report = compare(BenchSpec(model, repeats=args.repeats, new_tokens=args.new_tokens, threads=args.threads))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate.json").write_text(json.dumps(report, indent=2))
    (args.out / "generate.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
