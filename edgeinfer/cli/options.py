"""The options more than one command takes, as ``Annotated`` types, so each reads the same everywhere.

A command declares them after a bare ``*``: ``def run(question, *, model: ModelOption = None, ...)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from edgeinfer.profiles import PROFILE_ENV

ModelOption = Annotated[Optional[Path], typer.Option(
    "--model", "-m", help="Hugging Face checkpoint folder. Default: the bundled demo model.",
    envvar="EDGEINFER_MODEL")]
# No envvar here: the loader reads $EDGEINFER_PROFILE itself, so it can say which one won.
ProfileOption = Annotated[Optional[str], typer.Option(
    "--profile", help=f"Profile NAME (see `edgeinfer profiles list`) or a YAML FILE; "
                      f"default: ${PROFILE_ENV}, else detected from this machine.")]
SetOption = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override one profile field, e.g. --set kv.block_size=32 (repeatable).")]
JsonOption = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object on stdout; an error too, as {\"error\": {type, code, message, "
                   "exit_code, detail}}, with the same exit code.")]
ImageOption = Annotated[list[str], typer.Option(
    "--image", "-i", help="Image file (JPEG, PNG, WebP, BMP, GIF, TIFF); '-' reads stdin. Repeatable.")]
BackendOption = Annotated[str, typer.Option(
    "--backend", help="auto: the fastest engines built and fresh for the profile (ONNX Runtime on a CPU, "
                      "TensorRT on CUDA), else torch | torch | onnxruntime | tensorrt. A named backend that is "
                      "missing is an error.")]
EnginesOption = Annotated[Optional[Path], typer.Option(
    "--engines", help="Root folder of built engines (<root>/<model>/<profile>/). Default: ./engines.",
    envvar="EDGEINFER_ENGINES")]
RootOption = Annotated[Path, typer.Option(
    "--root", help="Read /proc, /sys and /etc under this folder instead of /.", hidden=True)]
