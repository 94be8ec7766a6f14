"""``edgeinfer bench``: benchmarks that run their peer in the same run and write one raw JSON file each.

Every command prints where its raw file went. On a CPU, figures count only from quiet
runs: a run whose other processes' load average went over ``--max-load`` makes the command
exit 2 with the file marked ``"publishable": false`` (``--allow-noisy`` keeps it, still marked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from edgeinfer.bench.common import CACHE_ENV, DEFAULT_CACHE, SHAPES
from edgeinfer.bench.quiet import QUIET_LOAD
from edgeinfer.cli.build import Int4BlockSizeOption, Int4SymmetricOption
from edgeinfer.cli.errors import cli_errors

bench_app = typer.Typer(help="Benchmarks against transformers (and our other backends), measured in the same run.",
                        no_args_is_help=True)

ModelOption = Annotated[Optional[Path], typer.Option(
    "--model", "-m", help="Checkpoint folder. Default: a random checkpoint of --shape, built once under --cache.")]
ShapeOption = Annotated[str, typer.Option(
    help=f"Shape of the built checkpoint (random weights, published shapes): {', '.join(SHAPES)}.")]
CacheOption = Annotated[Path, typer.Option(help="Where built checkpoints are kept.",
                                           envvar=CACHE_ENV)]
OutOption = Annotated[Path, typer.Option("--out", "-o", help="Folder for the raw JSON file (and its .md summary).")]
RepeatsOption = Annotated[int, typer.Option(min=1, help="Timed runs; figures are the median of all of them.")]
WarmupOption = Annotated[int, typer.Option(min=0, help="Untimed runs before them (compilation, caches).")]
NewTokensOption = Annotated[int, typer.Option(min=2, help="Tokens generated per request (EOS ignored).")]
ThreadsOption = Annotated[int, typer.Option(min=1, help="CPU threads of each engine.")]
MaxLoadOption = Annotated[float, typer.Option(
    help="Quiet-run limit: other processes' 1-minute load average before and after every run (CPU figures).")]
AllowNoisyOption = Annotated[bool, typer.Option(
    help="Write the raw file even when runs were noisy (marked \"publishable\": false) and exit 0.")]


def _model(model: Path | None, shape: str, cache: Path) -> Path:
    from edgeinfer.bench.common import bench_checkpoint

    return model if model is not None else bench_checkpoint(shape, cache)


def _kinds(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def _done(path: Path) -> None:
    typer.echo(f"raw: {path}")


def _spec(factory, *args, **kwargs):
    """A benchmark spec; a value it refuses (an unknown kind or part) is a usage error (exit 2)."""
    try:
        return factory(*args, **kwargs)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


@bench_app.command("generate")
def generate(
    *,
    model: ModelOption = None,
    shape: ShapeOption = "smolvlm-256m",
    cache: CacheOption = DEFAULT_CACHE,
    out: OutOption = Path("bench-results"),
    image_size: Annotated[int, typer.Option(help="Side of the square random picture, in pixels.")] = 512,
    new_tokens: NewTokensOption = 64,
    repeats: RepeatsOption = 5,
    warmup: WarmupOption = 1,
    threads: ThreadsOption = 2,
    kinds: Annotated[str, typer.Option(
        help="Engines, comma-separated: transformers (always), ours, onnxruntime, onnxruntime-int8, "
             "onnxruntime-int4, onnxruntime-int8-vision-int8, onnxruntime-int4-vision-int8.")]
    = "transformers,ours",
    max_load: MaxLoadOption = QUIET_LOAD,
    allow_noisy: AllowNoisyOption = False,
) -> None:
    """Time to first token, decode and whole-request tokens/s, peak RSS on a CPU: ours against transformers."""
    from edgeinfer.bench.generate import GenerateSpec, bench

    with cli_errors():
        spec = _spec(GenerateSpec, _model(model, shape, cache), image_size=image_size, new_tokens=new_tokens,
                            repeats=repeats, warmup=warmup, threads=threads, kinds=_kinds(kinds))
        _done(bench(spec, out, max_load=max_load, allow_noisy=allow_noisy, log=typer.echo))


@bench_app.command("onnxruntime")
def onnxruntime(
    *,
    model: ModelOption = None,
    shape: ShapeOption = "smolvlm-256m",
    cache: CacheOption = DEFAULT_CACHE,
    out: OutOption = Path("bench-results"),
    image_size: Annotated[int, typer.Option(help="Side of the square random picture, in pixels.")] = 512,
    new_tokens: NewTokensOption = 64,
    repeats: RepeatsOption = 5,
    warmup: WarmupOption = 1,
    threads: ThreadsOption = 2,
    max_load: MaxLoadOption = QUIET_LOAD,
    allow_noisy: AllowNoisyOption = False,
    kinds: Annotated[Optional[str], typer.Option(
        help="Engines, comma-separated (transformers always). Default: transformers, ours, onnxruntime, "
             "onnxruntime-int8, onnxruntime-int4, onnxruntime-int8-vision-int8, onnxruntime-int4-vision-int8.")] = None,
    demo_accuracy: Annotated[int, typer.Option(
        metavar="N", help="Instead of the speed run: answer N held-out demo questions with torch and ORT fp32, "
                          "int8, int4 and int4 with the int8 vision graph, and report their accuracy.")] = 0,
    seed: Annotated[int, typer.Option(help="Held-out seed of --demo-accuracy.")] = 1234,
    int4_block_size: Int4BlockSizeOption = None,
    int4_symmetric: Int4SymmetricOption = None,
) -> None:
    """ONNX Runtime fp32, int8 and int4 against transformers and our torch backend on a CPU (or demo accuracy)."""
    from edgeinfer.bench import onnxruntime as ort
    from edgeinfer.bench.generate import KINDS, GenerateSpec

    with cli_errors():
        if demo_accuracy:
            _done(ort.accuracy(demo_accuracy, seed, cache / "demo-engines", out))
            return
        spec = _spec(GenerateSpec, _model(model, shape, cache), image_size=image_size, new_tokens=new_tokens,
                            repeats=repeats, warmup=warmup, threads=threads,
                            kinds=_kinds(kinds) if kinds else KINDS, int4_block_size=int4_block_size,
                            int4_symmetric=int4_symmetric)
        _done(ort.speed(spec, out, max_load=max_load, allow_noisy=allow_noisy, log=typer.echo))


@bench_app.command("gpu")
def gpu(
    *,
    model: ModelOption = None,
    shape: ShapeOption = "qwen2-vl-2b",
    cache: CacheOption = DEFAULT_CACHE,
    out: OutOption = Path("bench-results"),
    image_size: Annotated[str, typer.Option(help="WIDTHxHEIGHT of the random pictures.")] = "1024x768",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,4,16",
    new_tokens: NewTokensOption = 64,
    repeats: RepeatsOption = 3,
    warmup: WarmupOption = 1,
    warmup_s: Annotated[float, typer.Option(
        min=0, help="With any warm-up, the first batch size's go on until this many seconds have passed: the "
                    "host's work can run slow for seconds after a short load, while torch.compile's compile "
                    "workers start.")] = 5.0,
    dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16 (float16 on boards without "
                                            "fast bf16).")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cuda, cuda:N (cpu only to check the code paths).")] = "cuda",
    kinds: Annotated[str, typer.Option(
        help="Engines, comma-separated: ours, transformers-static (compiled), transformers-dynamic.")]
    = "ours,transformers-static,transformers-dynamic",
    bandwidth_mib: Annotated[int, typer.Option(min=1, help="Buffer size of each bandwidth probe.")] = 1024,
    weights: Annotated[Optional[str], typer.Option(
        help="Weight formats ours runs, comma-separated: the checkpoint as it is (bf16, or fp16 / fp32 to match "
             "--dtype), w8a16, w4a16, w8a16-h8 and w4a16-h8 (with an int8 lm_head), w4a16-h4 (with a 4-bit "
             "lm_head; each quantized once by "
             "`edgeinfer quantize --method rtn`, kept under --cache). "
             "The transformers peers run the checkpoint as it is only. Default: the checkpoint as it is.")] = None,
    group_size: Annotated[int, typer.Option(min=1, help="Input columns per scale of w8a16 / w4a16.")] = 128,
    sampling: Annotated[str, typer.Option(
        help="Comma-separated: greedy, sampled (temperature 0.7, top-p 0.9, a seed per request); every engine "
             "runs once per mode, in the same run.")] = "greedy",
    engine_timeout: Annotated[Optional[float], typer.Option(
        min=1, help="Seconds each engine may take, load and compilation included; one that takes longer is "
                    "stopped and named under errors in the raw file, the others' figures are kept.")] = None,
    max_load: MaxLoadOption = QUIET_LOAD,
    allow_noisy: AllowNoisyOption = False,
) -> None:
    """Decode-only and whole-request tokens/s per batch size, first token, memory, each weight format's
    byte roofline and a Jetson projection on a GPU."""
    from edgeinfer.bench.gpu import GpuBenchSpec, bench
    from edgeinfer.profiles import parse_size

    with cli_errors():
        spec = _spec(GpuBenchSpec, _model(model, shape, cache), image_size=parse_size(image_size),
                     batch_sizes=_batch_sizes(batch_sizes), new_tokens=new_tokens, repeats=repeats, warmup=warmup,
                     warmup_s=warmup_s, dtype=dtype, device=device, kinds=_kinds(kinds), bandwidth_mib=bandwidth_mib,
                     weights=_spec(_weights, weights, dtype), group_size=group_size, sampling=_kinds(sampling),
                     engine_timeout_s=engine_timeout)
        checkpoints = _quantized_checkpoints(spec, cache)
        _done(bench(spec, out, max_load=max_load, allow_noisy=allow_noisy, log=typer.echo, checkpoints=checkpoints))


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(b) for b in _kinds(text))
    except ValueError:
        raise typer.BadParameter(f"--batch-sizes takes comma-separated integers, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter(f"--batch-sizes takes positive integers, not {text!r}")
    return sizes


def _weights(text: str | None, dtype: str) -> tuple[str, ...]:
    from edgeinfer.bench.weights import parse_weights

    return () if text is None else parse_weights(text, dtype)


def _quantized_checkpoints(spec, cache: Path) -> dict[str, Path]:
    """Each weight format's checkpoint, quantizing (with a progress bar on stderr) what is not cached yet."""
    from edgeinfer.bench.gpu import prepare_weights
    from edgeinfer.bench.weights import is_quantized
    from edgeinfer.progress import RichSteps, stderr_bars

    if not any(map(is_quantized, spec.formats)):
        return prepare_weights(spec, cache)
    with stderr_bars() as progress:
        return prepare_weights(spec, cache, RichSteps(progress),
                               log=lambda line: progress.console.print(line, markup=False, highlight=False))


@bench_app.command("kv")
def kv(
    *,
    model: ModelOption = None,
    shape: ShapeOption = "smolvlm-256m",
    cache: CacheOption = DEFAULT_CACHE,
    out: OutOption = Path("bench-results"),
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda where available).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Default: float32 on a CPU, bfloat16 on CUDA.")] = None,
    threads: ThreadsOption = 2,
    repeats: RepeatsOption = 3,
    parts: Annotated[str, typer.Option(
        help="Comma-separated: resume, overhead, round_robin, peer (CUDA), drift, demo.")]
    = "resume,overhead,round_robin,peer,drift,demo",
    history_tokens: Annotated[int, typer.Option(help="Tokens of the resumed session.")] = 1024,
    session_tokens: Annotated[int, typer.Option(help="Tokens of each round-robin session's opening.")] = 384,
    sessions: Annotated[int, typer.Option(min=1, help="Round-robin sessions.")] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Round-robin turns per session.")] = 3,
    new_tokens: NewTokensOption = 16,
    demo_questions: Annotated[int, typer.Option(help="Demo-model questions of the demo part.")] = 140,
    max_load: MaxLoadOption = QUIET_LOAD,
    allow_noisy: AllowNoisyOption = False,
) -> None:
    """The KV spill manager: resume, spill overhead, round robin, offloading peer (CUDA), drift."""
    from edgeinfer.bench.kv import KVBenchSpec, bench

    with cli_errors():
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        spec = _spec(KVBenchSpec, model=_model(model, shape, cache), device=device,
                           dtype=dtype or ("bfloat16" if device.startswith("cuda") else "float32"), threads=threads,
                           repeats=repeats, parts=_kinds(parts), history_tokens=history_tokens,
                           session_tokens=session_tokens, sessions=sessions, rounds=rounds, new_tokens=new_tokens,
                           demo_questions=demo_questions)
        _done(bench(spec, out, max_load=max_load, allow_noisy=allow_noisy, say=typer.echo))


@bench_app.command("sleep")
def sleep(
    *,
    model: ModelOption = None,
    shape: ShapeOption = "qwen2-vl-2b",
    cache: CacheOption = DEFAULT_CACHE,
    out: OutOption = Path("bench-results"),
    profile: Annotated[str, typer.Option(help="Profile the engine runs with (cuda on a GPU, cpu to check "
                                              "the code paths).")] = "cuda",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override one profile field (repeatable).")]
    = None,
    image_size: Annotated[str, typer.Option(help="WIDTHxHEIGHT of the random picture.")] = "1024x768",
    repeats: RepeatsOption = 3,
) -> None:
    """Memory a level-1 and a level-2 sleep free, and the seconds from a wake to the next first token."""
    from edgeinfer.bench import raw
    from edgeinfer.bench.sleep import SleepBenchSpec, bench, markdown
    from edgeinfer.profiles import parse_size

    with cli_errors():
        spec = _spec(SleepBenchSpec, _model(model, shape, cache), profile, tuple(set_ or ()),
                     parse_size(image_size), repeats)
        report = bench(spec)
        _done(raw.write(out, f"sleep-{spec.profile}-{Path(spec.model).name}", report, markdown(report)))



@bench_app.command("serve")
def serve(
    *,
    model: ModelOption = None,
    shape: ShapeOption = "qwen2-vl-2b",
    cache: CacheOption = DEFAULT_CACHE,
    out: OutOption = Path("bench-results"),
    profile: Annotated[str, typer.Option(help="Profile the engine and its limits come from (cuda on a GPU).")]
    = "cuda",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override one profile field (repeatable).")]
    = None,
    image_size: Annotated[str, typer.Option(help="WIDTHxHEIGHT of the random pictures.")] = "1024x768",
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per request (EOS ignored).")] = 128,
    burst: Annotated[int, typer.Option(min=0, help="Requests submitted at once in the burst part (0: skip).")] = 32,
    first_seen: Annotated[int, typer.Option(
        min=0, help="Requests at once, twice: the first time this batch size runs against the second (0: skip).")]
    = 8,
    rates: Annotated[str, typer.Option(help="Open-loop Poisson arrival rates, requests/s, comma-separated.")]
    = "1,2,4,8,16,32",
    requests: Annotated[int, typer.Option(min=1, help="Requests per open-loop rate.")] = 64,
    sampled_share: Annotated[float, typer.Option(help="Share of requests sampled (temperature 0.7, top-p 0.9, "
                                                      "seeded); the rest are greedy.")] = 0.5,
    ttft_slo_s: Annotated[float, typer.Option(help="The open loop stops after the first rate whose first-token "
                                                   "p99 passes this (or that refused a request).")] = 2.0,
    seed: Annotated[int, typer.Option(help="Seed of the pictures, the arrivals and the sampled share.")] = 0,
) -> None:
    """Many requests through the daemon's engine: a burst, the first time a batch size is seen,
    and open-loop arrivals until saturation (throughput, first token and streaming gaps)."""
    from edgeinfer.bench import raw
    from edgeinfer.bench.serve import ServeBenchSpec, bench, markdown
    from edgeinfer.profiles import parse_size

    with cli_errors():
        spec = _spec(ServeBenchSpec, _model(model, shape, cache), profile, tuple(set_ or ()), parse_size(image_size),
                     new_tokens, burst, first_seen, tuple(float(r) for r in _kinds(rates)), requests, sampled_share,
                     ttft_slo_s, seed)
        report = bench(spec, say=typer.echo)
        _done(raw.write(out, f"serve-{spec.profile}-{Path(spec.model).name}", report, markdown(report)))
