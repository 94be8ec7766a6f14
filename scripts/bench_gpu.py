"""GPU benchmark: ours against transformers' generate() on random checkpoints with real shapes.

    python scripts/bench_gpu.py --models smolvlm-256m,qwen2-vl-2b --out bench-results/

Builds each checkpoint once under --cache (random weights, published shapes), then runs
`python -m edgeinfer.bench.gpu` on it: time to first token, decode tokens/s at batch 1, 4
and 16, peak device memory and the fraction of the copy-bandwidth roofline. Runs unchanged
on a Jetson (pass --dtype float16 on boards without fast bf16).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeinfer.bench.gpu import main as bench_main
from edgeinfer.testing.checkpoints import make_checkpoint

FAMILIES = {"smolvlm-256m": "smolvlm", "qwen2-vl-2b": "qwen2_vl"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgeinfer" / "bench")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kinds", default="ours,transformers-dynamic,transformers-static")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for size in args.models.split(","):
        model = args.cache / size
        if not (model / "config.json").is_file():
            make_checkpoint(FAMILIES[size], model, size=size)
        bench_main(["--model", str(model), "--out", str(args.out), "--dtype", args.dtype, "--kinds", args.kinds,
                    "--repeats", str(args.repeats)])


if __name__ == "__main__":
    main()
