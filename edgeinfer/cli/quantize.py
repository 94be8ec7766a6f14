"""``edgeinfer quantize``: write a checkpoint's language model as 4- or 8-bit compressed-tensors weights."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.options import JsonOption


class QuantMethod(str, Enum):
    rtn = "rtn"
    awq = "awq"


class LmHead(str, Enum):
    int8 = "int8"
    int4 = "int4"

    @property
    def bits(self) -> int:
        return int(self.value.removeprefix("int"))


def quantize(model: Annotated[Path, typer.Argument(help="Hugging Face checkpoint folder to quantize.")],
             out: Annotated[Path, typer.Argument(help="Folder to write; must not exist or be empty (see --force).")],
             *,
             bits: Annotated[int, typer.Option(help="Weight bits: 4 or 8.")] = 4,
             group_size: Annotated[int, typer.Option(
                 help="Input columns sharing one scale; 0 or -1: one scale per output channel.")] = 128,
             method: Annotated[QuantMethod, typer.Option(
                 help="rtn: round to nearest with min-max scales; awq: activation-aware scales searched on "
                      "calibration pictures first.")] = QuantMethod.rtn,
             calibration: Annotated[Optional[Path], typer.Option(
                 help="awq: folder of pictures, with prompts.txt (one prompt a line) if wanted. "
                      "Default: the demo generator's pictures and questions.")] = None,
             samples: Annotated[int, typer.Option(help="awq: calibration samples (picture + prompt).")] = 64,
             lm_head: Annotated[Optional[LmHead], typer.Option(
                 help="Also quantize the output projection (lm_head): int8 per row, or int4 in the layers' groups "
                      "(about half int8's bytes). Default: kept as it is.")] = None,
             symmetric: Annotated[bool, typer.Option(
                 "--symmetric/--asymmetric", help="Symmetric scales, or scales with a zero point.")] = True,
             dtype: Annotated[Optional[str], typer.Option(
                 help="Load MODEL in this dtype first (float32, float16 or bfloat16): the scales and the weights "
                      "kept unquantized are written in it, as llm-compressor writes a model loaded in that dtype. "
                      "Default: the checkpoint's own.")] = None,
             force: Annotated[bool, typer.Option(help="Write into OUT even when it is not empty.")] = False,
             json_: JsonOption = False) -> None:
    """Quantize the language model's linear layers of MODEL and write OUT as a compressed-tensors
    (pack-quantized) checkpoint that transformers and vLLM load; the vision tower, the projector and
    the embeddings keep their dtype."""
    with cli_errors(json_):
        report = _quantize(model, out, bits, group_size, method, calibration, samples, lm_head, symmetric, force,
                           quiet=json_, dtype=dtype)
    if json_:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    _print_report(report)


def _quantize(model: Path, out: Path, bits: int, group_size: int, method: QuantMethod, calibration: Path | None,
              samples: int, lm_head: LmHead | None, symmetric: bool, force: bool, quiet: bool, dtype: str | None = None):
    from edgeinfer.progress import RichSteps, stderr_bars
    from edgeinfer.quant.compress import Method, QuantizeOptions, QuantSpec
    from edgeinfer.quant.quantize import quantize_checkpoint

    spec = QuantSpec.from_options(bits, group_size, symmetric, lm_head.bits if lm_head else None)
    options = QuantizeOptions(model, out, spec, Method(method.value), calibration, samples, force, dtype=dtype)
    with stderr_bars(disable=quiet) as progress:  # calibrating, searching scales, quantizing
        return quantize_checkpoint(options, RichSteps(progress))


def _print_report(report) -> None:
    group = "channel" if report.group_size is None else str(report.group_size)
    prefix = _decoder_prefix([layer.name for layer in report.layers])
    table = Table(title=f"{report.method} W{report.bits} group {group} "
                        f"{'symmetric' if report.symmetric else 'asymmetric'}: relative error per layer",
                  caption=f"layers under {prefix or '(top level)'}")
    for column in ("layer", "shape", "bits", "weight error", "output error", "alpha"):
        table.add_column(column, justify="left" if column == "layer" else "right", no_wrap=column == "layer")
    for layer in report.layers:
        table.add_row(layer.name.removeprefix(prefix), "x".join(map(str, layer.shape)), str(layer.bits),
                      f"{layer.weight_error:.4f}", "-" if layer.output_error is None else f"{layer.output_error:.4f}",
                      "-" if layer.alpha is None else f"{layer.alpha:.2f}")
    console = Console()
    console.print(table)
    console.print(f"wrote {report.out} ({len(report.layers)} layers quantized; report: quantize-report.json)")


def _decoder_prefix(names: list[str]) -> str:
    """``model.language_model.`` of ``model.language_model.layers.0.mlp.up_proj``: what every layer name shares."""
    stems = [name.split("layers.", 1)[0] for name in names if "layers." in name]
    return stems[0] if stems and all(stem == stems[0] for stem in stems) else ""
