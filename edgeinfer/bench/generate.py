"""CPU generation benchmark: ours against transformers' generate(), one request at a time.

Each engine runs in its own worker process, so its peak RSS is its own; the transformers
worker holds nothing of ours (its prompt ids and pixels come from transformers' own
processor). Both answer the same question about the same picture with exactly
``new_tokens`` tokens; ours' vision cache is cleared before every request, so both pay for
the vision encoder every time. Per run, both sides record:

- time to first token, from before preprocessing to the first token;
- decode tokens/s, from the first token to the last;
- whole request tokens/s, ``new_tokens`` over the time from before preprocessing to the end.

Figures are medians of every timed run (with min and max), ratios are ours over
transformers; the raw file holds every run with the load average around it. On a CPU
the figures may be published only when every timed run was quiet (``quiet.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from edgeinfer.bench import raw
from edgeinfer.bench.common import bench_image, environment, peak_rss_mb
from edgeinfer.bench.quiet import QUIET_LOAD, LoadTracker, RunLog, judge, refuse_if_noisy
from edgeinfer.bench.stats import Spread, ratio, spread

QUESTION = "Can you describe this image?"
PEER = "transformers"
# Our ONNX Runtime kinds -> the decoder precision each builds (on the cpu profile) and further
# `edgeinfer build` flags.
ONNX_KINDS = {"onnxruntime": "fp32", "onnxruntime-int8": "int8", "onnxruntime-int4": "int4",
              "onnxruntime-int8-vision-int8": "int8", "onnxruntime-int4-vision-int8": "int4"}
ONNX_BUILD_FLAGS = {kind: ("--vision-precision", "int8") for kind in ONNX_KINDS if kind.endswith("-vision-int8")}
KINDS = (PEER, "ours", *ONNX_KINDS)
FIGURES = ("ttft_s", "decode_tok_s", "request_tok_s")


@dataclass(frozen=True)
class GenerateSpec:
    model: Path
    image_size: int = 512
    new_tokens: int = 64
    repeats: int = 5
    warmup: int = 1
    threads: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    kinds: tuple[str, ...] = (PEER, "ours")
    engines: Path | None = None  # where ONNX Runtime kinds are built (default: beside the checkpoint)
    # How the int4 kinds are quantized (`edgeinfer build --int4-block-size / --int4-symmetric`); None: the build's default
    int4_block_size: int | None = None
    int4_symmetric: bool | None = None

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
        if PEER not in self.kinds:
            raise ValueError(f"{PEER} must be among the kinds: every figure is a ratio to it")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "model": str(self.model), "engines": str(self.engines) if self.engines else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GenerateSpec":
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in names}
        return cls(**{**data, "model": Path(data["model"]), "kinds": tuple(data["kinds"]),
                      "engines": Path(data["engines"]) if data.get("engines") else None})

    def build_flags(self, kind: str) -> tuple[str, ...]:
        """The ``edgeinfer build`` options of an ONNX Runtime kind beyond its precision."""
        from edgeinfer.artifacts import int4_flags

        int4 = int4_flags({"block_size": self.int4_block_size, "symmetric": self.int4_symmetric})
        return (*ONNX_BUILD_FLAGS.get(kind, ()), *(int4 if ONNX_KINDS.get(kind) == "int4" else ()))

    def onnx_engines(self, kind: str) -> Path:
        """Engines root of an ONNX Runtime kind; one per kind, so fp32 and int8 never replace each other."""
        root = self.engines or self.model.parent / f"{self.model.name}-engines"
        return root / kind


# --- ours (in its worker) ------------------------------------------------------------------------

def run_ours(spec: GenerateSpec, kind: str = "ours") -> dict[str, Any]:
    import torch

    from edgeinfer.bench.gpu import prompt_digest
    from edgeinfer.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(spec.threads)
    # No prefix cache: a repeat would reuse the previous one's prompt KV, which the peer never does.
    config = EngineConfig(dtype=spec.dtype, device=spec.device, threads=spec.threads, num_blocks=256, block_size=16,
                          vision_cache_entries=1, prefix_cache=False)
    if kind in ONNX_KINDS:  # built beforehand, in its own process (build memory is not this worker's RSS)
        os.environ["EDGEINFER_ENGINES"] = str(spec.onnx_engines(kind))
        engine = Engine.load(spec.model, profile="cpu", overrides=[f"build.precision={ONNX_KINDS[kind]}"],
                             backend="onnxruntime", config=config)
    else:
        engine = Engine.load(spec.model, config=config)
    params = SamplingParams(max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens)
    log = RunLog()
    prompt: list[int] = []
    with torch.inference_mode():
        for i in range(spec.warmup + spec.repeats):
            image = bench_image(spec.image_size)
            engine.vision_cache.clear()  # every request pays for its vision encoder, as the peer's does
            timed = i >= spec.warmup
            with log.run(f"{kind} #{i - spec.warmup}" if timed else f"{kind} warm-up {i}", timed) as rec:
                started = time.perf_counter()
                seq = engine.submit(QUESTION, [image], params)
                result = engine.run_until_done([seq])[0]
                request_s = time.perf_counter() - started
                rec.update(ttft_s=result.timings["ttft_s"], decode_tok_s=result.timings["decode_tokens_per_s"],
                           request_s=request_s, request_tok_s=len(result.token_ids) / request_s,
                           tokens=len(result.token_ids), vision_s=result.timings["vision_s"])
            prompt = seq.prompt_ids
    return {"runs": log.records, "peak_rss_mb": peak_rss_mb(), "prompt_tokens": len(prompt),
            "prompt_digest": prompt_digest(prompt)}


# --- the run ---------------------------------------------------------------------------------------

def summarize(records: list[dict[str, Any]]) -> dict[str, Spread]:
    """Median, min and max of every timed run's figures."""
    timed = [r for r in records if r.get("timed")]
    return {key: spread(r.get(key) for r in timed) for key in FIGURES}


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind of ours: decode and whole-request speed-ups, first-token and peak-RSS ratios, over the peer."""
    peer = summary[PEER]
    return {kind: {"decode": ratio(s["decode_tok_s"].median, peer["decode_tok_s"].median),
                   "request": ratio(s["request_tok_s"].median, peer["request_tok_s"].median),
                   "ttft": ratio(s["ttft_s"].median, peer["ttft_s"].median),
                   "peak_rss": ratio(s["peak_rss_mb"], peer["peak_rss_mb"])}
            for kind, s in summary.items() if kind != PEER}


def build_onnx(spec: GenerateSpec, kind: str) -> None:
    """Export (or confirm) the engines of an ONNX Runtime kind, outside the timed worker."""
    import subprocess

    from edgeinfer.bench.common import module_command

    cmd = module_command("edgeinfer.cli.main", "build", "--backend", "onnxruntime", "--model", str(spec.model),
                         "--profile", "cpu", "--out", str(spec.onnx_engines(kind)),
                         "--set", f"build.precision={ONNX_KINDS[kind]}", *spec.build_flags(kind))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{kind} build failed:\n{done.stderr[-4000:]}{done.stdout[-2000:]}")


def run(spec: GenerateSpec, log: Callable[[str], None] = print,
        after_each: Callable[[dict[str, Any], dict[str, str], list[str]], None] | None = None,
        ) -> tuple[dict[str, Any], dict[str, str]]:
    """Every kind in its own worker; (results by kind, errors by kind). ``after_each`` is called
    after every kind but the last, done or failed, with those so far and the kinds still to run."""
    from edgeinfer.bench.common import call_worker

    results, errors = {}, {}
    for i, kind in enumerate(spec.kinds):
        if after_each is not None and i:
            after_each(results, errors, list(spec.kinds[i:]))
        started = time.perf_counter()
        log(f"[bench generate] {kind} ...")
        try:
            if kind in ONNX_KINDS:
                build_onnx(spec, kind)
            results[kind] = call_worker(f"generate-{kind}", spec.to_json())
        except RuntimeError as error:
            errors[kind] = str(error)
            log(f"[bench generate] {kind} failed:\n{str(error)[-2000:]}")
            continue
        log(f"[bench generate] {kind}: {time.perf_counter() - started:.0f} s")
    return results, errors


def report(spec: GenerateSpec, results: dict[str, Any], errors: dict[str, str], share_at: Callable[[float], float],
           max_load: float, allow_noisy: bool, benchmark: str = "generate", pending: Sequence[str] = ()):
    """The raw file's content and the quiet verdict; ``pending``: kinds not run yet (a partial
    file, not publishable)."""
    records = [r for result in results.values() for r in result["runs"]]
    verdict = judge(records, share_at, max_load, enforced=spec.device == "cpu")
    same_prompt = len({r["prompt_digest"] for r in results.values()}) <= 1
    summary = {kind: {**summarize(r["runs"]), "peak_rss_mb": r["peak_rss_mb"], "prompt_tokens": r["prompt_tokens"]}
               for kind, r in results.items()}
    body = {"results": {k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in results.items()},
            "runs": {k: v["runs"] for k, v in results.items()}, "summary": summary,
            "ratios": ratios(summary) if PEER in summary else {}, "errors": errors, "same_prompt": same_prompt}
    head = raw.header(benchmark, spec.to_json(), environment(spec.device, spec.threads))
    problems = raw.comparison_problems(errors, same_prompt) + raw.incomplete(pending)
    return raw.with_verdict({**head, **body}, verdict, allow_noisy, problems), verdict


def _cell(s: Spread, digits: int) -> str:
    return f"{s.median:.{digits}f} ({s.min:.{digits}f}–{s.max:.{digits}f})" if s.n else "–"


def _int4_note(spec: dict[str, Any]) -> str:
    """How the int4 kinds were built, where not as the build's default."""
    given = [f"blocks of {spec['int4_block_size']}"] if spec.get("int4_block_size") is not None else []
    if spec.get("int4_symmetric") is not None:
        given.append("symmetric" if spec["int4_symmetric"] else "asymmetric")
    return f" int4 kinds built with {', '.join(given)}." if given else ""


def markdown(data: dict[str, Any]) -> str:
    summary, by_kind = data["summary"], data["ratios"]
    spec = data["spec"]
    lines = [f"Medians of {spec['repeats']} runs (min–max), after {spec['warmup']} untimed; {spec['new_tokens']} "
             f"tokens; {spec['threads']} threads.{_int4_note(spec)}", "",
             "| engine | prompt tokens | time to first token (s) | decode (tok/s) | whole request (tok/s) | "
             "peak RSS (MB) |", "|---|---|---|---|---|---|"]
    for kind in (k for k in KINDS if k in summary):
        s = summary[kind]
        lines.append(f"| {kind} | {s['prompt_tokens']} | {_cell(s['ttft_s'], 2)} | {_cell(s['decode_tok_s'], 1)} | "
                     f"{_cell(s['request_tok_s'], 2)} | {s['peak_rss_mb']:.0f} |")
    for kind, r in by_kind.items():
        lines.append(f"| **{kind} / {PEER}** | | **{r['ttft']:.2f}×** | **{r['decode']:.2f}×** | "
                     f"**{r['request']:.2f}×** | **{r['peak_rss']:.2f}×** |")
    if not data["same_prompt"]:
        lines.append("\n**The engines' prompt ids differ: this comparison is not like for like.**")
    for kind, error in data["errors"].items():
        lines.append(f"\n{kind} failed:\n```\n{error[-1500:]}\n```")
    return "\n".join(lines) + "\n"


def bench(spec: GenerateSpec, out: Path, *, max_load: float = QUIET_LOAD, allow_noisy: bool = False,
          benchmark: str = "generate", stem: str | None = None, extra: Callable[[dict], dict] | None = None,
          log: Callable[[str], None] = print) -> Path:
    """Run the benchmark, write ``cpu-generate-<model>.json`` (+ ``.md``) under ``out``, return its path.
    Raises ``LimitExceeded`` for noisy runs on a CPU, after writing the file marked unpublishable.
    The file is rewritten after every kind, marked incomplete until the last."""
    stem = stem or f"{spec.device}-generate-{spec.model.name}"

    def content(results, errors, pending=()):
        data, verdict = report(spec, results, errors, tracker.share_at, max_load, allow_noisy, benchmark, pending)
        return (extra(data) if extra is not None else data), verdict

    def keep_so_far(results, errors, pending):  # a run stopped early leaves what its finished kinds measured
        data, _ = content(results, errors, pending)
        raw.write(out, stem, data, markdown(data))

    with LoadTracker() as tracker:
        results, errors = run(spec, log, after_each=keep_so_far)
    data, verdict = content(results, errors)
    text = markdown(data)
    path = raw.write(out, stem, data, text)
    log(text)
    raw.refuse_if_problems(data["problems"], path)
    refuse_if_noisy(verdict, path, allow_noisy)
    return path
