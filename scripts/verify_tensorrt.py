#!/usr/bin/env python3
"""Build the TensorRT engines and check them against the torch backend on this machine.

    python scripts/verify_tensorrt.py                          # demo model, detected profile
    python scripts/verify_tensorrt.py --checkpoint ~/models/SmolVLM-256M-Instruct --profile orin-nx-16gb
    python scripts/verify_tensorrt.py --out tensorrt-report/ --n 140 --set build.workspace_mb=2048

For the bundled demo model and, when given, one more checkpoint:

1. builds both engines with ``edgeinfer build --backend tensorrt``'s code (skipped when the
   manifest's fingerprint still matches; ``--force`` rebuilds), and records the build
   time, the plan sizes and whether any layer of the decoder engine copies a whole KV pool;
2. answers the same questions with the tensorrt and the torch backend, greedy, with the
   same profile: the demo model's held-out synthetic set (accuracy of each, per question
   type) or, for a checkpoint, noise pictures with fixed questions;
3. compares the generated token ids (token parity) and times the vision engine, the
   prefill and the decode of both backends, in the same run.

Writes ``tensorrt.json`` and ``tensorrt.md`` under ``--out``. Exit status: 0 when every
check passes, 1 when one fails, 4 when TensorRT or a CUDA GPU is missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from edgeinfer.demo import DEMO_MODEL_DIR  # noqa: E402

# Checks that decide the exit status (see docs/tensorrt.md, "Reading the report").
MIN_PARITY = 0.9  # share of answers whose token ids equal torch's, at the profile's precision
MAX_ACCURACY_DROP = 0.02  # demo model: accuracy under tensorrt may trail torch's by this much
CHECKPOINT_QUESTIONS = ("describe this picture", "what colour dominates the image?", "what is in the image?",
                        "is there any text in this picture?")


def require_tensorrt():
    try:
        import tensorrt
    except ImportError:
        print("verify_tensorrt: the 'tensorrt' Python package is not importable here. On a Jetson it comes "
              "with JetPack (sudo apt install python3-libnvinfer); on another CUDA machine: pip install "
              "'edgeinfer[tensorrt]'. See docs/tensorrt.md.", file=sys.stderr)
        raise SystemExit(4)
    import torch

    if not torch.cuda.is_available():
        print("verify_tensorrt: TensorRT is installed but torch sees no CUDA GPU; TensorRT engines need one.",
              file=sys.stderr)
        raise SystemExit(4)
    return tensorrt


def environment(trt) -> dict:
    import torch

    from edgeinfer.device import detect_device

    device = detect_device()
    props = torch.cuda.get_device_properties(0)
    return {"tensorrt": trt.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": props.name, "sm": f"{props.major}.{props.minor}", "device": device.describe(),
            "jetpack": device.jetpack, "l4t": device.l4t_version, "python": platform.python_version()}


# --------------------------------------------------------------------------- build


def pool_copies(plan_path: Path) -> list[str]:
    """Layers of the decoder engine that take a whole KV pool and are not a gather (a reformat
    or cast there would copy the pool every step). Needs the engine's detailed layer information."""
    import tensorrt as trt

    from edgeinfer.backends.tensorrt.build import trt_logger

    engine = trt.Runtime(trt_logger()).deserialize_cuda_engine(plan_path.read_bytes())
    info = json.loads(engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON))
    found = []
    for layer in info.get("Layers", []):
        if not isinstance(layer, dict):
            continue
        inputs = [i.get("Name") for i in layer.get("Inputs", []) if isinstance(i, dict)]
        if {"k_pool", "v_pool"} & set(inputs) and "gather" not in str(layer.get("LayerType", "")).lower():
            found.append(f"{layer.get('Name')} ({layer.get('LayerType')})")
    return found


def build(model_dir: Path, profile, args) -> dict:
    from edgeinfer.backends.tensorrt.build import build_tensorrt_engines

    started = time.perf_counter()
    result = build_tensorrt_engines(model_dir, profile, args.engines, force=args.force)
    section = result.manifest.to_json()["tensorrt"]
    sizes = {name: round((result.folder / name).stat().st_size / 2**20, 2) for name in section["plans"]}
    return {"folder": str(result.folder), "skipped": result.skipped, "wall_s": round(time.perf_counter() - started, 1),
            "build_seconds": section.get("build_seconds", {}), "plan_mib": sizes,
            "engines": {name: {"flags": e["flags"], "workspace_mib": e["workspace_bytes"] // 2**20,
                               "dla_core": e["dla_core"], "shapes": e["shapes"]}
                        for name, e in section["engines"].items()},
            "pool_copies": pool_copies(result.folder / "decoder.plan")}


# --------------------------------------------------------------------------- answers, parity, timings


def questions(label: str, args) -> list[tuple[str, object, str | None, str | None]]:
    """(question, picture, expected answer, question type) for the demo set or a checkpoint."""
    if label == "demo":
        from edgeinfer.demo import synthetic

        return [(s.question, s.image, s.answer, s.qtype) for s in synthetic.held_out(args.seed, args.n)]
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(args.seed)
    count = min(args.n, 16)
    return [(CHECKPOINT_QUESTIONS[i % len(CHECKPOINT_QUESTIONS)],
             Image.fromarray(rng.randint(0, 256, (rng.randint(200, 800), rng.randint(200, 800), 3), dtype=np.uint8)),
             None, None) for i in range(count)]


def run_backend(backend: str, model_dir: Path, profile, items, args) -> dict:
    import torch

    from edgeinfer.engine import Engine, SamplingParams

    engine = Engine.load(model_dir, profile=profile, backend=backend)
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens)
    engine.generate(items[0][0], [items[0][1]], greedy)  # warm-up: lazy init, first kernels
    vision = []
    for _, picture, _, _ in items[: args.timed_images]:
        tensors = engine.adapter.process_image(picture.convert("RGB")).tensors
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.vision_engine.encode(tensors)
        torch.cuda.synchronize()
        vision.append(time.perf_counter() - started)
    results = [engine.generate(q, [picture], greedy) for q, picture, _, _ in items]
    engine.close()
    del engine
    torch.cuda.empty_cache()
    decode = [r.timings["decode_tokens_per_s"] for r in results if r.timings["decode_tokens_per_s"]]
    return {"tokens": [r.token_ids for r in results], "texts": [r.text for r in results],
            "vision_ms": 1000 * statistics.median(vision) if vision else None,
            "prefill_ms": 1000 * statistics.median(r.timings["prefill_s"] for r in results),
            "ttft_ms": 1000 * statistics.median(r.timings["ttft_s"] for r in results),
            "decode_tokens_per_s": statistics.median(decode) if decode else None}


def parity(trt_tokens: list[list[int]], torch_tokens: list[list[int]]) -> dict:
    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    differ = [{"index": i, "first_difference": common(a, b), "tensorrt": a, "torch": b}
              for i, (a, b) in enumerate(zip(trt_tokens, torch_tokens)) if a != b]
    n = len(trt_tokens)
    return {"n": n, "identical": n - len(differ), "share": (n - len(differ)) / n if n else 0.0,
            "differences": differ[:10]}


def accuracy(texts: list[str], items) -> dict:
    from eval_demo import normalized

    per_type: dict[str, list[int]] = {}
    for text, (_, _, expected, qtype) in zip(texts, items):
        per_type.setdefault(qtype, [0, 0])
        per_type[qtype][0] += 1
        per_type[qtype][1] += normalized(text) == expected
    total = sum(n for n, _ in per_type.values())
    correct = sum(c for _, c in per_type.values())
    return {"n": total, "correct": correct, "accuracy": correct / total if total else 0.0,
            "per_type": {q: {"n": n, "correct": c} for q, (n, c) in per_type.items()}}


def verify_model(label: str, model_dir: Path, profile, args) -> dict:
    entry = {"model": label, "path": str(model_dir), "build": build(model_dir, profile, args)}
    items = questions(label, args)
    runs = {backend: run_backend(backend, model_dir, profile, items, args) for backend in ("tensorrt", "torch")}
    entry["parity"] = parity(runs["tensorrt"]["tokens"], runs["torch"]["tokens"])
    entry["timings"] = {backend: {k: v for k, v in run.items() if k not in ("tokens", "texts")}
                        for backend, run in runs.items()}
    entry["ratios"] = ratios(entry["timings"])
    checks = {"parity": entry["parity"]["share"] >= MIN_PARITY, "no_pool_copy": not entry["build"]["pool_copies"]}
    if label == "demo":
        entry["accuracy"] = {backend: accuracy(run["texts"], items) for backend, run in runs.items()}
        drop = entry["accuracy"]["torch"]["accuracy"] - entry["accuracy"]["tensorrt"]["accuracy"]
        checks["accuracy"] = drop <= MAX_ACCURACY_DROP
    entry["checks"] = checks
    return entry


def ratios(timings: dict) -> dict:
    """torch time over tensorrt time (above 1: tensorrt is faster), measured in this run."""
    trt, ref = timings["tensorrt"], timings["torch"]
    out = {}
    for key in ("vision_ms", "prefill_ms", "ttft_ms"):
        if trt.get(key) and ref.get(key):
            out[key.replace("_ms", "_speedup")] = ref[key] / trt[key]
    if trt.get("decode_tokens_per_s") and ref.get("decode_tokens_per_s"):
        out["decode_speedup"] = trt["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
    return out


# --------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    env = report["environment"]
    overrides = f" with {' '.join(report['overrides'])}" if report["overrides"] else ""
    setting = (f"Profile `{report['profile']}`{overrides}; {env['device']}; JetPack {env['jetpack'] or '-'}; "
               f"torch {env['torch']} (CUDA {env['cuda']}).")
    lines = [f"# TensorRT verification: {env['gpu']} (SM {env['sm']}), TensorRT {env['tensorrt']}", "", setting, ""]
    for entry in report["models"]:
        build_, timing = entry["build"], entry["timings"]
        state = "skipped (up to date)" if build_["skipped"] else "built"
        built = (f"Build: {state} in {build_['wall_s']} s; plans {build_['plan_mib']} MiB; "
                 f"layers copying a KV pool: {build_['pool_copies'] or 'none'}.")
        lines += [f"## {entry['model']} ({entry['path']})", "", built, "",
                  "| | tensorrt | torch | ratio |", "|---|---|---|---|"]
        for key, ratio in (("vision_ms", "vision_speedup"), ("prefill_ms", "prefill_speedup"),
                           ("ttft_ms", "ttft_speedup"), ("decode_tokens_per_s", "decode_speedup")):
            row = [timing["tensorrt"].get(key), timing["torch"].get(key), entry["ratios"].get(ratio)]
            lines.append(f"| {key} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in row) + " |")
        p = entry["parity"]
        lines += ["", f"Token parity: {p['identical']}/{p['n']} answers with identical token ids."]
        if "accuracy" in entry:
            acc = entry["accuracy"]
            lines.append(f"Demo accuracy: tensorrt {acc['tensorrt']['accuracy']:.1%}, "
                         f"torch {acc['torch']['accuracy']:.1%} ({acc['torch']['n']} questions).")
        lines += ["", "Checks: " + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in entry["checks"].items()), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="a Hugging Face checkpoint folder to verify too")
    parser.add_argument("--profile", default=None, help="profile name or YAML file (default: detected)")
    parser.add_argument("--set", action="append", default=[], help="profile override, as edgeinfer's --set")
    parser.add_argument("--engines", type=Path, default=Path("engines"), help="engines root")
    parser.add_argument("--out", type=Path, default=Path("tensorrt-report"))
    parser.add_argument("--n", type=int, default=140, help="demo questions (20 per question type)")
    parser.add_argument("--seed", type=int, default=4321, help="held-out seed (the demo model's own check seed)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--timed-images", type=int, default=8, help="pictures the vision engine is timed on")
    parser.add_argument("--force", action="store_true", help="rebuild the engines even when up to date")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trt = require_tensorrt()
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.profiles import load_profile

    # No disk tier: a prefix persisted by one backend must not answer for the other.
    profile = load_profile(args.profile, [*args.set, "memory.disk_tier_mb=0"])
    report = {"environment": environment(trt), "profile": profile.name, "overrides": args.set, "models": []}
    models = [("demo", DEMO_MODEL_DIR)] + ([("checkpoint", args.checkpoint)] if args.checkpoint else [])
    try:
        for label, path in models:
            report["models"].append(verify_model(label, path, profile, args))
    except EdgeInferError as error:
        print(f"verify_tensorrt: {error}", file=sys.stderr)
        return error.exit_code
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tensorrt.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (args.out / "tensorrt.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return 0 if all(all(m["checks"].values()) for m in report["models"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
