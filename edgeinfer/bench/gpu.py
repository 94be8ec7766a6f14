"""Decode and first-token benchmark on a GPU (or a Jetson): ours against transformers' generate().

One run, each engine in its own worker process (so peak memory is its own):

- ours: the torch backend with the profile's dtype and CUDA graphs over decode steps;
- transformers, dynamic cache (eager);
- transformers, static cache (generate compiles its decode step).

Each reports the median time to first token at batch 1, decode tokens/s at every batch
size, and peak device memory. The run also measures the device's copy bandwidth and turns
decode speed into a fraction of the memory-bandwidth roofline: bytes read per step
(text weights + KV of every sequence) over the step time, against that bandwidth.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from edgeinfer.bench.common import bench_image, sync
from edgeinfer.bench.generate import _Clock  # the token clock is shared with the CPU benchmark
from edgeinfer.profiles import parse_size

QUESTION = "Describe this image."
KINDS = ("ours", "transformers-dynamic", "transformers-static")


@dataclass(frozen=True)
class GpuBenchSpec:
    model: Path
    image_size: tuple[int, int] = (1024, 768)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    new_tokens: int = 64
    repeats: int = 3
    dtype: str = "bfloat16"
    device: str = "cuda"
    kinds: tuple[str, ...] = KINDS

    def args(self) -> list[str]:
        return ["--model", str(self.model), "--image-size", f"{self.image_size[0]}x{self.image_size[1]}",
                "--batch-sizes", ",".join(map(str, self.batch_sizes)), "--new-tokens", str(self.new_tokens),
                "--repeats", str(self.repeats), "--dtype", self.dtype, "--device", self.device]


def copy_bandwidth_gbs(device: str, mib: int = 1024) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), median of 10."""
    import torch

    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times) / 1e9


def peak_memory_mb(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- ours -------------------------------------------------------------------------------------

def run_ours(spec: GpuBenchSpec) -> dict:
    from edgeinfer.engine import Engine, EngineConfig, SamplingParams

    max_batch = max(spec.batch_sizes)
    # The picture's size is named as a profile names its cameras' (runtime.vision_compile_sizes),
    # so the tower is ready for it at load: captured in a CUDA graph, or compiled.
    config = EngineConfig(dtype=spec.dtype, device=spec.device, max_batch_size=max_batch, block_size=16,
                          kv_budget_mb=1024, max_context=4096, prefill_chunk=4096, vision_cache_entries=1,
                          cuda_graphs=spec.device.startswith("cuda"), prefix_cache=False,
                          vision_compile_sizes=(spec.image_size,) if spec.device.startswith("cuda") else ())
    engine = Engine.load(spec.model, config=config)
    # A fixed length, as the peers' min_new_tokens gives; no prefix cache, so every request
    # pays for its prefill as theirs do.
    params = SamplingParams(max_new_tokens=spec.new_tokens, ignore_eos=True)
    image = bench_image(spec.image_size)
    ttft, vision, prefill, decode = [], [], [], {b: [] for b in spec.batch_sizes}
    prompt_tokens = 0
    for i in range(spec.repeats + 1):
        engine.vision_cache.clear()  # every repeat pays for its vision encoder, as the peers do
        sync(spec.device)
        result = engine.generate(QUESTION, [image], params)
        prompt_tokens = result.usage["prompt_tokens"]
        if i:
            ttft.append(result.timings["ttft_s"])
            vision.append(result.timings["vision_s"])
            prefill.append(result.timings["prefill_s"])
        for b in spec.batch_sizes:
            seqs = [engine.submit(QUESTION, [image], params) for _ in range(b)]
            while any(not s.generated for s in seqs):
                engine.step()
            sync(spec.device)
            start = time.perf_counter()
            counted = sum(len(s.generated) for s in seqs)
            engine.run_until_done(seqs)
            sync(spec.device)
            if i:
                decode[b].append((sum(len(s.generated) for s in seqs) - counted) / (time.perf_counter() - start))
    decoder = engine.model.decoder
    weight_bytes = sum(p.numel() * p.element_size() for n, p in decoder.named_parameters() if n != "embed")
    kv_bytes_per_token = engine.kv.bytes_per_block // engine.config.block_size
    return {"ttft_s": statistics.median(ttft), "decode_tok_s": {b: statistics.median(v) for b, v in decode.items()},
            "vision_s": statistics.median(vision), "prefill_s": statistics.median(prefill),
            "prompt_tokens": prompt_tokens, "text_weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token, "peak_memory_mb": peak_memory_mb(spec.device),
            "cuda_graph_captures": getattr(engine.decoder_engine, "captures", 0),
            "decode_steps": engine.counters["decode_steps"], "decode_bursts": engine.counters["decode_bursts"],
            "decode_bursts_ahead": engine.counters["decode_bursts_ahead"],
            "prefill_replays": getattr(engine.decoder_engine, "prefill_replays", 0),
            "prefill_error": getattr(engine.decoder_engine, "prefill_error", None),
            "weight_layout": getattr(engine.decoder_engine, "weight_layout", None),
            "decode_kernels": getattr(engine.decoder_engine, "kernel_report", None),
            "vision_compiled": bool(getattr(engine.vision_engine, "compiled_signatures", None)),
            "vision_captured": bool(getattr(engine.vision_engine, "captured_signatures", None)),
            "vision_capture_error": getattr(engine.vision_engine, "capture_error", None),
            "vision_compile_error": engine.vision_compile_error,
            "compile_error": getattr(engine.decoder_engine, "compile_error", None)}


# --- transformers ----------------------------------------------------------------------------------

def prompt_ids(model: Path, images) -> tuple[object, list[int]]:
    """Our prompt ids for the question (checked equal to transformers' processors in the tests)."""
    from edgeinfer.engine.inputs import expand_images, render_chat, tokenize, user_message
    from edgeinfer.models.loader import read_checkpoint

    checkpoint, adapter_cls = read_checkpoint(model)
    adapter = adapter_cls(checkpoint)
    processed = [adapter.process_image(im) for im in images]
    text = expand_images(render_chat(adapter, user_message(QUESTION, len(images))), adapter.image_marker, processed)
    return adapter, tokenize(adapter, text, processed).token_ids


def vision_kwargs(adapter, images, batch: int, device: str, dtype) -> dict:
    """The image processor's tensors for transformers' model, repeated for a batch."""
    import torch

    from edgeinfer.models.idefics3 import Idefics3Adapter

    nested = isinstance(adapter, Idefics3Adapter)
    out = adapter.image_processor(images=[images] * batch if nested else images * batch, return_tensors="pt")
    kwargs = {}
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            kwargs[key] = value.to(device, dtype) if value.is_floating_point() else value.to(device)
    return kwargs


def run_transformers(spec: GpuBenchSpec, cache: str) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    dtype = getattr(torch, spec.dtype)
    image = bench_image(spec.image_size)
    adapter, ids = prompt_ids(spec.model, [image])
    model = AutoModelForImageTextToText.from_pretrained(spec.model, dtype=dtype).to(spec.device).eval()
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    ttft, decode = [], {b: [] for b in spec.batch_sizes}
    for i in range(spec.repeats + 1):
        for b in sorted(set(spec.batch_sizes) | {1}):
            input_ids = torch.tensor([ids] * b, device=spec.device)
            sync(spec.device)
            start = time.perf_counter()
            kwargs = vision_kwargs(adapter, [image], b, spec.device, dtype)
            clock = _Clock()
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs,
                           max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False,
                           streamer=clock if b == 1 else None, **extra)
            sync(spec.device)
            end = time.perf_counter()
            if not i:
                continue  # warm-up (and compilation for the static cache)
            if b == 1:
                ttft.append(clock.times[0] - start)
                if 1 in decode:
                    decode[1].append((len(clock.times) - 1) / (clock.times[-1] - clock.times[0]))
            else:
                decode[b].append(b * spec.new_tokens / (end - start))  # includes its prefill: a lower bound
    return {"ttft_s": statistics.median(ttft), "decode_tok_s": {b: statistics.median(v) for b, v in decode.items()},
            "prompt_tokens": len(ids), "peak_memory_mb": peak_memory_mb(spec.device)}


def worker(kind: str, spec: GpuBenchSpec) -> dict:
    import torch

    with torch.inference_mode():
        if kind == "ours":
            return run_ours(spec)
    return run_transformers(spec, "static" if kind.endswith("static") else "dynamic")


# --- the run ---------------------------------------------------------------------------------------

@dataclass
class Report:
    spec: dict
    environment: dict
    bandwidth_gbs: float
    results: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def roofline(self) -> dict:
        ours = self.results.get("ours")
        if not ours:
            return {}
        out = {}
        context = ours["prompt_tokens"] + self.spec["new_tokens"] / 2
        for b, rate in ours["decode_tok_s"].items():
            bytes_per_step = ours["text_weight_bytes"] + int(b) * context * ours["kv_bytes_per_token"]
            roof = self.bandwidth_gbs * 1e9 / bytes_per_step * int(b)
            out[b] = {"roofline_tok_s": roof, "fraction": rate / roof}
        return out


def environment(device: str) -> dict:
    import platform

    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def run(spec: GpuBenchSpec) -> Report:
    import torch

    with torch.inference_mode():
        bandwidth = copy_bandwidth_gbs(spec.device)
    report = Report(asdict(spec) | {"model": str(spec.model)}, environment(spec.device), bandwidth)
    for kind in spec.kinds:
        # Each batch size is a new static shape for the compiled peer: batch 1 only keeps its
        # compile time bounded; its decode rate at batch 1 is the figure the target names.
        run_spec = replace(spec, batch_sizes=(1,)) if kind == "transformers-static" else spec
        cmd = [sys.executable, "-m", "edgeinfer.bench.gpu", "--worker", kind, *run_spec.args()]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if done.returncode:
            report.errors[kind] = done.stderr[-3000:]
            continue
        report.results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def markdown(report: Report) -> str:
    r, roof = report.results, report.roofline()
    batches = [str(b) for b in report.spec["batch_sizes"]]
    head = "| engine | TTFT b=1 (ms) | " + " | ".join(f"decode b={b} (tok/s)" for b in batches) + " | peak mem (MB) |"
    lines = [head, "|---" * (3 + len(batches)) + "|"]
    for kind, x in r.items():
        rates = " | ".join(f"{x['decode_tok_s'].get(b, float('nan')):.0f}" for b in batches)
        lines.append(f"| {kind} | {x['ttft_s'] * 1e3:.1f} | {rates} | {x['peak_memory_mb']:.0f} |")
    if "ours" in r:
        for peer in ("transformers-dynamic", "transformers-static"):
            if peer in r:
                ratios = " | ".join(
                    f"{r['ours']['decode_tok_s'][b] / r[peer]['decode_tok_s'][b]:.2f}×"
                    if b in r[peer]["decode_tok_s"] else "" for b in batches)
                lines.append(f"| ours / {peer} | {r['ours']['ttft_s'] / r[peer]['ttft_s']:.2f}× | {ratios} | |")
    lines.append("")
    lines.append(f"Copy bandwidth {report.bandwidth_gbs:.0f} GB/s. Roofline (ours): " + ", ".join(
        f"b={b}: {v['fraction'] * 100:.0f}% of {v['roofline_tok_s']:.0f} tok/s" for b, v in roof.items()))
    for kind, err in report.errors.items():
        lines.append(f"\n{kind} failed:\n```\n{err[-1500:]}\n```")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=KINDS)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--image-size", default="1024x768")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    w, h = parse_size(args.image_size)
    spec = GpuBenchSpec(args.model, (w, h), tuple(int(b) for b in args.batch_sizes.split(",")), args.new_tokens,
                        args.repeats, args.dtype, args.device, tuple(args.kinds.split(",")))
    return args, spec


def main(argv=None) -> None:
    args, spec = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, spec)))
        return
    report = run(spec)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-{spec.model.name}"
    (args.out / f"{stem}.json").write_text(json.dumps(asdict(report) | {"roofline": report.roofline()}, indent=2))
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
