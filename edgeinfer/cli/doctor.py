"""``edgeinfer doctor``: is this machine ready, and what to do where it is not."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.options import JsonOption, ProfileOption, RootOption, SetOption
from edgeinfer.doctor import Check, any_failed, run_checks

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def _print_report(checks: list[Check]) -> None:
    table = Table("check", "status", "detail")
    for check in checks:
        table.add_row(check.name, f"[{_STYLE[check.status]}]{check.status}[/]", check.detail)
    Console(soft_wrap=True).print(table)
    # Fixes go below the table, unwrapped, so each command can be copied whole.
    for check in checks:
        if check.fix and check.status != "pass":
            typer.echo(f"{check.status} {check.name}: {check.fix}")


def doctor(*,
           model: Annotated[Optional[Path], typer.Option(
               "--model", help="Also check this checkpoint folder.", envvar="EDGEINFER_MODEL")] = None,
           engines: Annotated[Path, typer.Option(
               "--engines", help="Folder of built engines to check.", envvar="EDGEINFER_ENGINES")] = Path("engines"),
           profile: ProfileOption = None,
           set_: SetOption = None,
           json_: JsonOption = False,
           root: RootOption = Path("/")) -> None:
    """Check Python, torch, CUDA, TensorRT, JetPack, power, memory, the model and built engines."""
    with cli_errors(json_):
        checks = run_checks(root=root, model_dir=model, engines_dir=engines, profile=profile, overrides=set_ or ())
    failed = any_failed(checks)
    if json_:
        typer.echo(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        _print_report(checks)
    if failed:
        raise typer.Exit(1)
