"""``edgeinfer cache stats|clear|verify``: the persisted KV blocks and vision entries on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.options import JsonOption, ProfileOption, SetOption

if TYPE_CHECKING:  # the KV room imports torch: every command's --help would wait for it
    from edgeinfer.kv.inventory import CacheReport

cache_app = typer.Typer(help="See, clear and check the persisted cache (KV blocks, vision entries).",
                        no_args_is_help=True)

DirOption = Annotated[Path | None, typer.Option(
    "--dir", help="The cache folder. Default: the profile's kv.disk_dir, else $XDG_CACHE_HOME/edgeinfer/kv.",
    envvar="EDGEINFER_CACHE_DIR")]
ModelPrefix = Annotated[str | None, typer.Option(
    "--model", help="Only the folder whose digest or model fingerprint starts with this (see `cache stats`).")]


def cache_root(folder: Path | None, profile: str | None, overrides: list[str] | None) -> Path:
    if folder is not None:
        return folder.expanduser()
    from edgeinfer.kv.disk import default_cache_dir
    from edgeinfer.profiles import load_profile

    disk_dir = load_profile(profile, overrides or ()).kv.disk_dir
    return Path(disk_dir).expanduser() if disk_dir else default_cache_dir()


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _said(report: CacheReport) -> str:
    t = report.totals()
    return {
        "stats": f"{len(report.folders)} model folders, {t['kv_blocks']} KV blocks ({_size(t['kv_bytes'])}), "
                 f"{t['vision_entries']} vision entries ({_size(t['vision_bytes'])})",
        "clear": f"removed {t['removed_blocks']} KV blocks and {t['removed_vision']} vision entries, "
                 f"freed {_size(t['freed_bytes'])}",
        "verify": f"checked every checksum: {t['damaged_blocks']} damaged KV blocks and {t['damaged_vision']} "
                  f"damaged vision entries found and removed",
    }[report.action]


def _print(report: CacheReport, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({**report.to_dict(), "summary": _said(report)}, indent=2))
        return
    table = Table(title=f"{report.root}")
    for name in ("folder", "fingerprint"):
        table.add_column(name, no_wrap=True, min_width=12)
    for name in ("codec", "KV blocks", "KV bytes", "vision", "vision bytes"):
        table.add_column(name, no_wrap=True)
    table.add_column("note")
    for f in report.folders:
        done = {"clear": f"removed {f.removed_blocks} blocks, {f.removed_vision} vision",
                "verify": f"damaged {f.damaged_blocks} blocks, {f.damaged_vision} vision"}.get(report.action, "")
        table.add_row(f.digest[:12], f.fingerprint[:12], f.codec, str(f.kv_blocks), _size(f.kv_bytes),
                      str(f.vision_entries), _size(f.vision_bytes), f.skipped or done)
    console = Console(soft_wrap=True)
    console.print(table)
    console.print(f"{report.action}: {_said(report)}")


@cache_app.command("stats")
def stats(*, dir_: DirOption = None, model: ModelPrefix = None, profile: ProfileOption = None,
          set_: SetOption = None, json_: JsonOption = False) -> None:
    """Model folders, KV blocks and bytes, per-model fingerprints, vision entries."""
    with cli_errors(json_):
        from edgeinfer.kv.inventory import cache_stats

        _print(cache_stats(cache_root(dir_, profile, set_), model), json_)


@cache_app.command("clear")
def clear(*, dir_: DirOption = None, model: ModelPrefix = None,
          vision: Annotated[bool, typer.Option("--vision", help="Clear the vision entries.")] = False,
          kv: Annotated[bool, typer.Option("--kv", help="Clear the KV blocks.")] = False,
          profile: ProfileOption = None, set_: SetOption = None, json_: JsonOption = False) -> None:
    """Remove KV blocks and vision entries (both unless --kv or --vision picks one)."""
    both = not (vision or kv)
    with cli_errors(json_):
        from edgeinfer.kv.inventory import clear_cache

        report = clear_cache(cache_root(dir_, profile, set_), model, kv=kv or both, vision=vision or both)
        _print(report, json_)


@cache_app.command("verify")
def verify(*, dir_: DirOption = None, model: ModelPrefix = None, profile: ProfileOption = None,
           set_: SetOption = None, json_: JsonOption = False) -> None:
    """Check every KV block and vision entry against its checksum; remove the damaged ones."""
    with cli_errors(json_):
        from edgeinfer.kv.inventory import verify_cache

        _print(verify_cache(cache_root(dir_, profile, set_), model), json_)
