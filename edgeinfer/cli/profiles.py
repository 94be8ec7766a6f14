"""``edgeinfer profiles``: list, show, detect and validate device profiles."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.options import JsonOption, RootOption, SetOption
from edgeinfer.device import detect_device
from edgeinfer.errors import EdgeInferError, exit_code_for
from edgeinfer.profiles import (
    choose_profile,
    list_profiles,
    load_profile,
    profile_fingerprint,
    profile_path,
    profile_to_dict,
    profile_to_yaml,
    validate_profile_file,
)

profiles_app = typer.Typer(help="List, show, detect and validate device profiles.", no_args_is_help=True)


def _console() -> Console:
    return Console(soft_wrap=True)


@profiles_app.command("list")
def list_command(*, json_: JsonOption = False) -> None:
    """Every shipped profile with the device it is for."""
    with cli_errors(json_):
        profiles = [load_profile(name) for name in list_profiles()]
    if json_:
        rows = [{"name": p.name, "kind": p.detect.kind, "total_mb": p.memory.total_mb,
                 "description": p.description, "file": str(profile_path(p.name))} for p in profiles]
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table("name", "kind", "memory", "description")
    for p in profiles:
        table.add_row(p.name, p.detect.kind, f"{p.memory.total_mb // 1024} GiB", p.description)
    _console().print(table)


@profiles_app.command("show")
def show_command(name: Annotated[str, typer.Argument(help="Profile NAME or YAML FILE.")],
                 *, set_: SetOption = None, json_: JsonOption = False) -> None:
    """The resolved profile (after --set overrides) as YAML or JSON."""
    with cli_errors(json_):
        profile = load_profile(name, set_ or ())
    if json_:
        data = {**profile_to_dict(profile), "fingerprint": profile_fingerprint(profile)}
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(f"# fingerprint: {profile_fingerprint(profile)}")
    typer.echo(profile_to_yaml(profile), nl=False)


@profiles_app.command("detect")
def detect_command(*, root: RootOption = Path("/"), json_: JsonOption = False) -> None:
    """What this machine is and which profile it gets (ignores --profile and the env)."""
    with cli_errors(json_):
        device = detect_device(root)
        choice = choose_profile(None, env={}, root=root)
    if json_:
        typer.echo(json.dumps({"device": asdict(device), "profile": choice.selector,
                               "reason": choice.reason}, indent=2))
        return
    table = Table("field", "value", show_header=False)
    for key, value in asdict(device).items():
        table.add_row(key, ", ".join(value) if isinstance(value, tuple) else str(value))
    table.add_row("profile", choice.selector)
    _console().print(table)
    typer.echo(choice.reason)


@profiles_app.command("validate")
def validate_command(files: Annotated[list[Path], typer.Argument(help="Profile YAML files.")]) -> None:
    """Check profile files; prints each error with its file and field, exit 2 on any."""
    worst = 0
    for file in files:
        try:
            profile = validate_profile_file(file)
        except EdgeInferError as error:
            typer.echo(f"error: {error}", err=True)
            worst = max(worst, exit_code_for(error))
            continue
        typer.echo(f"ok: {file} ({profile.name}, fingerprint {profile_fingerprint(profile)})")
    if worst:
        raise typer.Exit(worst)
