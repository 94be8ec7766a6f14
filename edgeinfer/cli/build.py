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



class BuildBackend(str, Enum):
    onnxruntime = "onnxruntime"
    tensorrt = "tensorrt"


class BuildPrecision(str, Enum):
    fp32 = "fp32"
    int8 = "int8"


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
              help="onnxruntime: decoder weights fp32, or int8 (dynamic quantization, for CPUs). tensorrt: "
                   "same as --set build.precision=... Default: the profile's build.precision.")] = None,
          out: Annotated[Path, typer.Option(
              "--engines", "--out", help="Root folder of built engines; writes ENGINES/<model>/<profile>/.",
              envvar="EDGEINFER_ENGINES")] = Path("engines"),
          force: Annotated[bool, typer.Option(help="Rebuild even when the manifest still matches.")] = False,
          json_: JsonOption = False) -> None:
    """Export the vision and decoder engines to ONNX, check them against torch, write the manifest;
    with --backend tensorrt, also build the TensorRT engines from those graphs."""
    with cli_errors(json_):
        result = _build(backend, model or DEMO_MODEL_DIR, profile, set_ or [], precision, out, force)
    if json_:
        typer.echo(json.dumps({"folder": str(result.folder), "skipped": result.skipped,
                               "reasons": list(result.reasons), "manifest": result.manifest.to_json()}, indent=2))
        return
    if backend is BuildBackend.tensorrt:
        _print_tensorrt(result)
        return
    _print_result(result)


def _build(backend: BuildBackend, model: Path, profile: str | None, overrides: list[str],
           precision: BuildPrecision | None, out: Path, force: bool):
    from edgeinfer.backends.onnx.build import BuildSpec, build_engines
    from edgeinfer.models.loader import load_model
    from edgeinfer.profiles import load_profile

    if backend is BuildBackend.tensorrt:
        from edgeinfer.backends.tensorrt.build import build_tensorrt_engines, import_tensorrt

        import_tensorrt()  # before any export: say at once what is missing
        extra = [f"build.precision={precision.value}"] if precision else []
        return build_tensorrt_engines(model, load_profile(profile, [*overrides, *extra]), out, force=force)
    chosen = load_profile(profile, overrides)
    spec = BuildSpec.from_profile(chosen, precision.value if precision else None)
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
