"""ONNX Runtime benchmark: our ONNX Runtime backend (fp32, int8, int4) against transformers and our torch backend.

The speed run is ``generate.py``'s method with its kinds (transformers, ours on torch, ours
on ONNX Runtime fp32, int8, int4, and int4 with the int8 vision graph), each in its own
worker; the ORT engines are built before their worker starts, so export memory never counts
as its RSS. The raw file adds the targets and whether each was met.

``demo_accuracy`` answers held-out questions of the bundled demo model with the torch
backend and each ORT build, and reports each one's accuracy and how often int8 and int4
give the fp32 answer (not timed).
"""

from __future__ import annotations

import os
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeinfer.bench import raw
from edgeinfer.bench.common import environment
from edgeinfer.bench.generate import KINDS, GenerateSpec
from edgeinfer.bench.generate import bench as generate_bench
from edgeinfer.bench.quiet import QUIET_LOAD
from edgeinfer.bench.stats import ratio
from edgeinfer.errors import ModelLoadError

TARGETS = {"onnxruntime": 1.5, "onnxruntime-int8": 2.5}  # decode speed-up over transformers


def with_targets(data: dict[str, Any]) -> dict[str, Any]:
    """The raw report with each ORT kind's target, its measured ratio and whether it was met,
    and, where both ran, int4's decode over int8's (a ratio beside them: no target is set for it)."""
    ratios_ = data["ratios"]
    measured = {kind: ratios_.get(kind, {}).get("decode") for kind in TARGETS}
    targets = {kind: {"decode_vs_transformers": target, "measured": measured[kind],
                      "met": measured[kind] is not None and measured[kind] >= target}
               for kind, target in TARGETS.items() if kind in ratios_}
    extra = {}
    if {"onnxruntime-int4", "onnxruntime-int8"} <= set(ratios_):
        extra["int4_decode_over_int8"] = ratio(ratios_["onnxruntime-int4"]["decode"],
                                               ratios_["onnxruntime-int8"]["decode"])
    return {**data, "targets": targets, **extra}


def speed(spec: GenerateSpec, out: Path, *, max_load: float = QUIET_LOAD, allow_noisy: bool = False,
          log: Callable[[str], None] = print) -> Path:
    """Every kind of ``KINDS`` (or ``spec.kinds``), written as ``cpu-onnxruntime-<model>.json``."""
    return generate_bench(spec, out, max_load=max_load, allow_noisy=allow_noisy, benchmark="onnxruntime",
                          stem=f"{spec.device}-onnxruntime-{spec.model.name}", extra=with_targets, log=log)


def _normalized(text: str) -> str:
    return text.strip().strip(string.punctuation + " ").lower()


def demo_accuracy(n: int, seed: int, engines_root: Path) -> dict[str, Any]:
    """Accuracy of torch and each ORT build on the demo model's held-out questions."""
    from edgeinfer.demo import DEMO_MODEL_DIR, synthetic
    from edgeinfer.engine import Engine, SamplingParams

    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise ModelLoadError(f"no demo model at {DEMO_MODEL_DIR}")
    samples = synthetic.held_out(seed, n)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    variants = {"torch": ("torch", []), "onnxruntime": ("onnxruntime", ["build.precision=fp32"]),
                "onnxruntime-int8": ("onnxruntime", ["build.precision=int8"]),
                "onnxruntime-int4": ("onnxruntime", ["build.precision=int4"]),
                "onnxruntime-int4-vision-int8": ("onnxruntime", ["build.precision=int4"])}
    answers: dict[str, list[str]] = {}
    for name, (backend, overrides) in variants.items():
        os.environ["EDGEINFER_ENGINES"] = str(engines_root / name)
        if name.endswith("vision-int8"):  # a profile does not pick the vision precision: built first
            _build_int8_vision(DEMO_MODEL_DIR, overrides, engines_root / name)
        engine = Engine.load(DEMO_MODEL_DIR, profile="cpu", overrides=overrides, backend=backend)
        started = time.perf_counter()
        answers[name] = [_normalized(engine.generate(s.question, [s.image], sampling).text) for s in samples]
        print(f"{name}: {time.perf_counter() - started:.1f} s for {n} questions", file=sys.stderr)
    report: dict[str, Any] = {"n": n, "seed": seed, "accuracy": {}, "per_type": {}}
    for name, got in answers.items():
        right = [a == s.answer for a, s in zip(got, samples)]
        report["accuracy"][name] = sum(right) / n
        report["per_type"][name] = {q: sum(r for r, s in zip(right, samples) if s.qtype == q)
                                    / max(1, sum(s.qtype == q for s in samples)) for q in synthetic.QTYPES}
    for precision in ("int8", "int4"):
        report[f"{precision}_agrees_with_fp32"] = sum(a == b for a, b in zip(answers[f"onnxruntime-{precision}"],
                                                                            answers["onnxruntime"])) / n
    return report


def _build_int8_vision(model_dir: Path, overrides: list[str], root: Path) -> None:
    from edgeinfer.backends.onnx.build import BuildSpec, build_engines
    from edgeinfer.models.loader import load_model
    from edgeinfer.profiles import load_profile

    spec = BuildSpec.from_profile(load_profile("cpu", overrides), vision_precision="int8")
    build_engines(load_model(model_dir), spec, root)


def demo_markdown(report: dict[str, Any]) -> str:
    lines = ["| engine | demo accuracy |", "|---|---|"]
    lines += [f"| {name} | {acc:.1%} |" for name, acc in report["accuracy"].items()]
    for precision in ("int8", "int4"):
        lines.append(f"\n{precision} answers equal fp32 answers on {report[f'{precision}_agrees_with_fp32']:.1%} of "
                     f"{report['n']} questions (seed {report['seed']}).")
    return "\n".join(lines) + "\n"


def accuracy(n: int, seed: int, engines_root: Path, out: Path) -> Path:
    """Run ``demo_accuracy`` and write ``demo-eval-onnxruntime.json`` (+ ``.md``) under ``out``."""
    report = demo_accuracy(n, seed, engines_root)
    head = raw.header("onnxruntime-demo-accuracy", {"n": n, "seed": seed}, environment("cpu"))
    path = raw.write(out, "demo-eval-onnxruntime", {**head, **report, "publishable": True}, demo_markdown(report))
    print(demo_markdown(report))
    return path


__all__ = ["KINDS", "TARGETS", "accuracy", "demo_accuracy", "speed", "with_targets"]
