"""Generation benchmark: time to first token, decode tokens/s and peak RSS, ours vs transformers.

Each engine runs in its own worker process so peak RSS is its own. Both see the same
checkpoint, image, prompt ids and forced token count; the report gives medians over the
repeats and the ratio ours / transformers.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.bench.common import bench_image
QUESTION = "Can you describe this image?"
# Worker kinds of our ONNX Runtime backend -> the decoder precision each builds (on the cpu profile).
ONNX_KINDS = {"onnxruntime": "fp32", "onnxruntime-int8": "int8"}
KINDS = ("transformers", "ours", *ONNX_KINDS)


@dataclass(frozen=True, slots=True)
class BenchSpec:
    model: Path
    image_size: int = 512
    new_tokens: int = 64
    repeats: int = 5
    threads: int = 2
    dtype: str = "float32"
    device: str = "cpu"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def onnx_engines(spec: BenchSpec, kind: str) -> Path:
    """Engines root of an ONNX Runtime kind; one per kind, so fp32 and int8 builds never replace each other."""
    return spec.model.parent / f"{spec.model.name}-engines" / kind


def onnx_overrides(kind: str) -> list[str]:
    return [f"build.precision={ONNX_KINDS[kind]}"]


def run_ours(spec: BenchSpec, kind: str = "ours") -> list[dict]:
    from edgeinfer.engine import Engine, EngineConfig, SamplingParams

    # No prefix cache: a repeat would reuse the previous one's prompt KV, which the peer never does.
    config = EngineConfig(dtype=spec.dtype, device=spec.device, threads=spec.threads, num_blocks=256, block_size=16,
                          vision_cache_entries=1, prefix_cache=False)
    if kind in ONNX_KINDS:  # built beforehand by compare(), in its own process
        os.environ["EDGEINFER_ENGINES"] = str(onnx_engines(spec, kind))
        engine = Engine.load(spec.model, profile="cpu", overrides=onnx_overrides(kind), backend="onnxruntime",
                             config=config)
    else:
        engine = Engine.load(spec.model, config=config)
    params = SamplingParams(max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens)
    runs = []
    for i in range(spec.repeats + 1):
        image = bench_image(spec.image_size)
        engine.vision_cache.clear()  # every repeat pays for its vision encoder, as the peer does
        result = engine.generate(QUESTION, [image], params)
        t = result.timings
        if i:  # the first run warms caches and allocators
            runs.append({"ttft_s": t["ttft_s"], "decode_tok_s": t["decode_tokens_per_s"],
                         "vision_s": t["vision_s"], "prompt_tokens": result.usage["prompt_tokens"]})
    return runs


class _Clock:
    """A transformers streamer that timestamps each generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(spec: BenchSpec) -> list[dict]:
    import torch
    from transformers import AutoModelForImageTextToText

    from edgeinfer.engine import Engine, EngineConfig

    dtype = getattr(torch, spec.dtype)
    model = AutoModelForImageTextToText.from_pretrained(spec.model, dtype=dtype).to(spec.device).eval()
    # Our adapter renders the same prompt ids; transformers' processor for SmolVLM needs torchvision.
    prompt = Engine.load(spec.model, config=EngineConfig(num_blocks=64, threads=spec.threads))
    image_processor = prompt.adapter.image_processor
    runs = []
    for i in range(spec.repeats + 1):
        image = bench_image(spec.image_size)
        start = time.perf_counter()
        inputs = image_processor(images=[[image]], return_tensors="pt")
        seq = prompt.submit(QUESTION, [image])
        prompt.cancel(seq)
        ids = torch.tensor([seq.prompt_ids], device=spec.device)
        clock = _Clock()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       pixel_values=inputs["pixel_values"].to(spec.device, dtype),
                       pixel_attention_mask=inputs["pixel_attention_mask"].to(spec.device),
                       max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False,
                       streamer=clock)
        first, last = clock.times[0], clock.times[-1]
        if i:
            runs.append({"ttft_s": first - start, "decode_tok_s": (len(clock.times) - 1) / (last - first),
                         "prompt_tokens": ids.shape[1]})
    return runs


def worker(kind: str, spec: BenchSpec) -> dict:
    import torch

    torch.set_num_threads(spec.threads)
    with torch.inference_mode():
        runs = run_transformers(spec) if kind == "transformers" else run_ours(spec, kind)
    return {"runs": runs, "peak_rss_mb": peak_rss_mb()}


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def build_onnx(spec: BenchSpec, kind: str) -> None:
    """Export (or confirm) the engines of an ONNX Runtime kind, outside the timed worker."""
    cmd = [sys.executable, "-m", "edgeinfer.cli.main", "build", "--backend", "onnxruntime", "--model", str(spec.model),
           "--profile", "cpu", "--out", str(onnx_engines(spec, kind))]
    for override in onnx_overrides(kind):
        cmd += ["--set", override]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{kind} build failed:\n{done.stderr[-4000:]}{done.stdout[-2000:]}")


def compare(spec: BenchSpec, kinds: tuple[str, ...] = ("transformers", "ours")) -> dict:
    results = {}
    for kind in kinds:
        if kind in ONNX_KINDS:
            build_onnx(spec, kind)
        cmd = [sys.executable, "-m", "edgeinfer.bench.generate", "--worker", kind, "--model", str(spec.model),
               "--image-size", str(spec.image_size), "--new-tokens", str(spec.new_tokens),
               "--repeats", str(spec.repeats), "--threads", str(spec.threads), "--dtype", spec.dtype,
               "--device", spec.device]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if done.returncode:
            raise RuntimeError(f"{kind} worker failed:\n{done.stderr[-4000:]}")
        results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    summary = {}
    for kind, data in results.items():
        runs = data["runs"]
        summary[kind] = {"ttft_s": _median(runs, "ttft_s"), "decode_tok_s": _median(runs, "decode_tok_s"),
                         "peak_rss_mb": data["peak_rss_mb"], "prompt_tokens": runs[0]["prompt_tokens"],
                         "repeats": len(runs)}
    peer = summary["transformers"]
    by_kind = {kind: {"decode": x["decode_tok_s"] / peer["decode_tok_s"], "ttft": x["ttft_s"] / peer["ttft_s"],
                      "peak_rss": x["peak_rss_mb"] / peer["peak_rss_mb"]}
               for kind, x in summary.items() if kind != "transformers"}
    ratios = by_kind.get("ours", {})
    return {"ratios_by_kind": by_kind,
            "spec": {k: str(v) for k, v in spec.__dict__.items()} if hasattr(spec, "__dict__") else
            {f: str(getattr(spec, f)) for f in spec.__slots__},
            "results": results, "summary": summary, "ratios": ratios, "environment": environment()}


def environment() -> dict:
    import platform

    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count()}


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "| engine | prompt tokens | time to first token (s) | decode (tok/s) | peak RSS (MB) |",
        "|---|---|---|---|---|",
    ]
    for kind in (k for k in KINDS if k in s):
        x = s[kind]
        lines.append(f"| {kind} | {x['prompt_tokens']} | {x['ttft_s']:.3f} | {x['decode_tok_s']:.1f} | "
                     f"{x['peak_rss_mb']:.0f} |")
    for kind, r in report.get("ratios_by_kind", {"ours": report["ratios"]}).items():
        lines.append(f"| **{kind} / transformers** | | **{r['ttft']:.2f}×** | **{r['decode']:.2f}×** | "
                     f"**{r['peak_rss']:.2f}×** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", choices=list(KINDS))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    spec = BenchSpec(args.model, args.image_size, args.new_tokens, args.repeats, args.threads, args.dtype, args.device)
    if args.worker:
        print(json.dumps(worker(args.worker, spec)))
        return
    print(json.dumps(compare(spec), indent=2))


if __name__ == "__main__":
    main()
