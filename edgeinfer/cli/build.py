"""``edgeinfer build``: export a checkpoint's engines, check them and write their manifest."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.options import JsonOption, ProfileOption, SetOption
from edgeinfer.demo import DEMO_MODEL_DIR
from edgeinfer.errors import EngineBuildError



class BuildBackend(str, Enum):
    onnxruntime = "onnxruntime"
    tensorrt = "tensorrt"


class BuildPrecision(str, Enum):
    fp32 = "fp32"
    int8 = "int8"
    int4 = "int4"


class Int4Format(str, Enum):
    matmulnbits = "matmulnbits"
    qdq = "qdq"


class HeadPrecision(str, Enum):
    int4 = "int4"
    int8 = "int8"
    fp32 = "fp32"


class VisionPrecision(str, Enum):
    fp32 = "fp32"
    int8 = "int8"


# Defaults of the int4 options are edgeinfer.backends.onnx.quantize.Int4Options'; None: not given.
Int4BlockSizeOption = Annotated[Optional[int], typer.Option(
    "--int4-block-size", help="int4: weights per scale along the input dimension: 32, 64 or 128. Default 128.")]
Int4SymmetricOption = Annotated[Optional[bool], typer.Option(
    "--int4-symmetric/--int4-asymmetric", help="int4: blocks without (symmetric) or with 4-bit zero points. "
                                               "Default symmetric.")]
Int4AccuracyOption = Annotated[Optional[int], typer.Option(
    "--int4-accuracy-level", help="int4: MatMulNBits accuracy_level, 0 (float32 activations) to 4 (int8 "
                                  "activations). Default 4, measured faster than 0 on a 2-core CPU (docs/onnxruntime.md).")]
Int4FormatOption = Annotated[Optional[Int4Format], typer.Option(
    "--int4-format", help="int4: matmulnbits (ONNX Runtime's operator) or qdq (block-quantized DequantizeLinear "
                          "before MatMul, opset 21, the form TensorRT 10 reads). Default matmulnbits.")]
Int4HeadOption = Annotated[Optional[HeadPrecision], typer.Option(
    "--int4-head", help="int4: the vocabulary projection in int4, int8 blocks or fp32. Default int4.")]
VisionPrecisionOption = Annotated[VisionPrecision, typer.Option(
    "--vision-precision", help="onnxruntime: vision graph weights fp32, or int8 (dynamic quantization of its "
                               "MatMul, Gemm and Conv weights).")]


def build(*,
          backend: Annotated[BuildBackend, typer.Option(
              help="Which engines to build: onnxruntime writes vision.onnx and decoder.onnx; tensorrt "
                   "builds vision.plan and decoder.plan from them with the profile's build settings."),
          ] = BuildBackend.onnxruntime,
          model: Annotated[Optional[Path], typer.Option(
              "--model", "-m", help="Hugging Face checkpoint folder. Default: the bundled demo model.",
              envvar="EDGEINFER_MODEL")] = None,
          profile: ProfileOption = None,
          set_: SetOption = None,
          precision: Annotated[Optional[BuildPrecision], typer.Option(
              help="onnxruntime: decoder weights fp32, int8 (dynamic quantization, for CPUs) or int4 (4-bit "
                   "blocks, MatMulNBits). tensorrt: same as --set build.precision=... Default: the profile's "
                   "build.precision.")] = None,
          int4_block_size: Int4BlockSizeOption = None,
          int4_symmetric: Int4SymmetricOption = None,
          int4_accuracy_level: Int4AccuracyOption = None,
          int4_format: Int4FormatOption = None,
          int4_head: Int4HeadOption = None,
          vision_precision: VisionPrecisionOption = VisionPrecision.fp32,
          out: Annotated[Path, typer.Option(
              "--engines", "--out", help="Root folder of built engines; writes ENGINES/<model>/<profile>/.",
              envvar="EDGEINFER_ENGINES")] = Path("engines"),
          force: Annotated[bool, typer.Option(help="Rebuild even when the manifest still matches.")] = False,
          json_: JsonOption = False) -> None:
    """Export the vision and decoder engines to ONNX, check them against torch, write the manifest;
    with --backend tensorrt, also build the TensorRT engines from those graphs."""
    given = {"block_size": int4_block_size, "symmetric": int4_symmetric, "accuracy_level": int4_accuracy_level,
             "format": int4_format.value if int4_format else None, "head": int4_head.value if int4_head else None}
    with cli_errors(json_):
        if backend is BuildBackend.tensorrt and (any(v is not None for v in given.values())
                                                 or vision_precision is not VisionPrecision.fp32):
            raise EngineBuildError("--int4-* and --vision-precision choose how the onnxruntime backend quantizes; "
                                   "the TensorRT build takes --precision", fix="--backend onnxruntime")
        result = _build(backend, model or DEMO_MODEL_DIR, profile, set_ or [], precision, out, force,
                        {k: v for k, v in given.items() if v is not None}, vision_precision.value)
    if json_:
        typer.echo(json.dumps({"folder": str(result.folder), "skipped": result.skipped,
                               "reasons": list(result.reasons), "manifest": result.manifest.to_json()}, indent=2))
        return
    if backend is BuildBackend.tensorrt:
        _print_tensorrt(result)
        return
    _print_result(result)


def _build(backend: BuildBackend, model: Path, profile: str | None, overrides: list[str],
           precision: BuildPrecision | None, out: Path, force: bool, int4: dict, vision_precision: str):
    """``int4``: the --int4-* options given (Int4Options' fields), the others keep their defaults."""
    from edgeinfer.backends.onnx.build import BuildSpec, build_engines
    from edgeinfer.backends.onnx.quantize import Int4Options
    from edgeinfer.models.loader import load_model
    from edgeinfer.profiles import load_profile

    if backend is BuildBackend.tensorrt:
        from edgeinfer.backends.tensorrt.build import build_tensorrt_engines, import_tensorrt

        import_tensorrt()  # before any export: say at once what is missing
        extra = [f"build.precision={precision.value}"] if precision else []
        return build_tensorrt_engines(model, load_profile(profile, [*overrides, *extra]), out, force=force)
    chosen = load_profile(profile, overrides)
    spec = BuildSpec.from_profile(chosen, precision.value if precision else None,
                                  int4=Int4Options(**int4), vision_precision=vision_precision)
    return build_engines(load_model(model), spec, out, force=force)


def _print_status(console: Console, result, matches: str) -> None:
    """Whether the build was skipped (and why that was allowed) or what made it run."""
    if result.skipped:
        console.print(f"up to date: {result.folder} ({matches}; --force rebuilds)")
        return
    for reason in result.reasons:
        console.print(f"(re)built because {reason}")
    console.print(f"built {result.folder}")


def _print_result(result) -> None:
    console = Console(soft_wrap=True)
    manifest = result.manifest
    _print_status(console, result, "the manifest matches")
    table = Table("engine", "runs on", "file", "size")
    for name, entry in manifest.engines.items():
        size = f"{(result.folder / entry.file).stat().st_size / 2**20:.1f} MiB" if entry.file else "-"
        runs_on = entry.runtime + (f" ({entry.precision})" if entry.precision else "")
        table.add_row(name, runs_on, entry.file or entry.document.get("reason", "-"), size)
    console.print(table)
    checks = manifest.document.get("checks", {})
    if checks:
        decoder = checks.get("decoder", {})
        worst = max((v for k, v in decoder.items() if isinstance(v, float) and k != "logit_scale"), default=0.0)
        vision = checks.get("vision", {}).get("max_abs_diff")
        console.print(f"checked against torch: decoder max |diff| {worst:.2e}"
                      + (f", vision max |diff| {vision:.2e}" if vision is not None else ""))


def _print_tensorrt(result) -> None:
    console = Console(soft_wrap=True)
    section = result.manifest.tensorrt
    _print_status(console, result, "the TensorRT fingerprint matches")
    fingerprint = section.fingerprint
    console.print(f"TensorRT {fingerprint.tensorrt} on {fingerprint.gpu} (SM {fingerprint.sm})")
    table = Table("engine", "file", "flags", "workspace", "DLA", "size", "built in")
    for name, entry in section.engines.items():
        path = result.folder / entry.plan_file
        size = f"{path.stat().st_size / 2**20:.1f} MiB" if path.is_file() else "-"
        seconds = section.build_seconds.get(name)
        table.add_row(name, entry.plan_file, ", ".join(entry.flags) or "fp32", f"{entry.workspace_bytes // 2**20} MiB",
                      "-" if entry.dla_core is None else f"core {entry.dla_core}", size,
                      "-" if seconds is None else f"{seconds:.0f} s")
    console.print(table)
