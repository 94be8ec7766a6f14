#!/usr/bin/env python3
"""Benchmark the ONNX Runtime backend (fp32 and int8) against our torch backend and transformers.

    python scripts/bench_onnxruntime.py --out bench-results/
    python scripts/bench_onnxruntime.py --demo-accuracy 700     # int8 accuracy on the demo model

One run measures, on a SmolVLM-256M-shaped random checkpoint (built once under --cache):
transformers' generate(), our torch backend, ORT fp32 and ORT int8, each in its own worker
process (decode tokens/s, time to first token, peak RSS; medians over --repeats). The ORT
engines are built before their worker starts, so export memory never counts as its RSS.
Writes onnxruntime.json and onnxruntime.md under --out.

--demo-accuracy N answers N held-out questions of the bundled demo model with the torch
backend, ORT fp32 and ORT int8, and reports each one's accuracy and how often int8 gives
the fp32 answer.
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.bench.generate import KINDS, BenchSpec, compare, markdown  # noqa: E402

TARGETS = {"onnxruntime": 1.5, "onnxruntime-int8": 2.5}  # decode speed-up over transformers


def speed(args: argparse.Namespace) -> dict:
    from edgeinfer.testing.checkpoints import make_checkpoint

    model = args.cache / f"smolvlm-{args.size}"
    if not (model / "model.safetensors").is_file():
        make_checkpoint("smolvlm", model, size=args.size)
    spec = BenchSpec(model, image_size=args.image_size, repeats=args.repeats, new_tokens=args.new_tokens,
                     threads=args.threads)
    report = compare(spec, kinds=tuple(args.kinds))
    report["targets"] = {kind: {"decode_vs_transformers": target,
                                "measured": report["ratios_by_kind"].get(kind, {}).get("decode")}
                         for kind, target in TARGETS.items() if kind in args.kinds}
    return report


def _normalized(text: str) -> str:
    return text.strip().strip(string.punctuation + " ").lower()


def demo_accuracy(n: int, seed: int, engines_root: Path) -> dict:
    """Accuracy of torch, ORT fp32 and ORT int8 on the demo model's held-out questions."""
    from edgeinfer.demo import DEMO_MODEL_DIR, synthetic
    from edgeinfer.engine import Engine, SamplingParams

    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise SystemExit(f"no demo model at {DEMO_MODEL_DIR}")
    samples = synthetic.held_out(seed, n)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    variants = {"torch": ("torch", []), "onnxruntime": ("onnxruntime", ["build.precision=fp32"]),
                "onnxruntime-int8": ("onnxruntime", ["build.precision=int8"])}
    answers: dict[str, list[str]] = {}
    for name, (backend, overrides) in variants.items():
        os.environ["EDGEINFER_ENGINES"] = str(engines_root / name)
        engine = Engine.load(DEMO_MODEL_DIR, profile="cpu", overrides=overrides, backend=backend)
        started = time.perf_counter()
        answers[name] = [_normalized(engine.generate(s.question, [s.image], sampling).text) for s in samples]
        print(f"{name}: {time.perf_counter() - started:.1f} s for {n} questions", file=sys.stderr)
    report = {"n": n, "seed": seed, "accuracy": {}, "per_type": {}}
    for name, got in answers.items():
        right = [a == s.answer for a, s in zip(got, samples)]
        report["accuracy"][name] = sum(right) / n
        report["per_type"][name] = {q: sum(r for r, s in zip(right, samples) if s.qtype == q)
                                    / max(1, sum(s.qtype == q for s in samples)) for q in synthetic.QTYPES}
    report["int8_agrees_with_fp32"] = sum(a == b for a, b in zip(answers["onnxruntime-int8"],
                                                                 answers["onnxruntime"])) / n
    return report


def demo_markdown(report: dict) -> str:
    lines = ["| engine | demo accuracy |", "|---|---|"]
    lines += [f"| {name} | {acc:.1%} |" for name, acc in report["accuracy"].items()]
    lines.append(f"\nint8 answers equal fp32 answers on {report['int8_agrees_with_fp32']:.1%} of "
                 f"{report['n']} questions (seed {report['seed']}).")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgeinfer" / "bench")
    parser.add_argument("--size", default="smolvlm-256m")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--demo-accuracy", type=int, default=0, metavar="N",
                        help="instead of the speed run, answer N held-out demo questions per engine")
    parser.add_argument("--seed", type=int, default=1234, help="held-out seed of --demo-accuracy")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.demo_accuracy:
        report = demo_accuracy(args.demo_accuracy, args.seed, args.cache / "demo-engines")
        (args.out / "onnxruntime_demo.json").write_text(json.dumps(report, indent=2))
        print(demo_markdown(report))
        return
    report = speed(args)
    (args.out / "onnxruntime.json").write_text(json.dumps(report, indent=2))
    (args.out / "onnxruntime.md").write_text(markdown(report))
    print(markdown(report))
    for kind, target in report["targets"].items():
        measured = target["measured"]
        verdict = "meets" if measured is not None and measured >= target["decode_vs_transformers"] else "misses"
        print(f"{kind}: decode {measured:.2f}x transformers, {verdict} the {target['decode_vs_transformers']}x target")


if __name__ == "__main__":
    main()
