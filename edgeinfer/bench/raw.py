"""Raw files: every benchmark writes one JSON file that every published figure links to.

The file holds what was run (command, commit, versions, spec), every run with the load
average around it, the summaries (median, min, max of all runs) and whether the figures
may be published (``"publishable"``, with the quiet-run verdict that decided it).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgeinfer.bench.common import git_state
from edgeinfer.bench.quiet import QuietVerdict
from edgeinfer.errors import EdgeInferError

SCHEMA = 2  # 1: the files before load averages, quiet verdicts and min/max were recorded


def print_and_save(data: dict[str, Any], out: Path | None) -> None:
    """A probe's result: printed as indented JSON and, with ``out``, written there too."""
    text = json.dumps(data, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON: NaN and infinities become null, paths and enums strings,
    dataclasses (or objects with ``to_dict``) dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (Path, enum.Enum)):
        return str(value.value if isinstance(value, enum.Enum) else value)
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def header(benchmark: str, spec: Any, environment: dict[str, Any], argv: Sequence[str] | None = None) -> dict:
    """The part of a raw file that says what ran, where and from which commit."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name in ("edgeinfer", "main.py", "__main__.py"):
        argv[0] = "edgeinfer"  # the command a reader types, not where this install lives
    return {"benchmark": benchmark, "schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(argv), "git": git_state(), "environment": environment, "spec": jsonable(spec)}


def with_verdict(report: dict[str, Any], verdict: QuietVerdict, allow_noisy: bool,
                 problems: Sequence[str] = ()) -> dict[str, Any]:
    """``report`` with its quiet-run verdict, what else keeps its figures from standing (an engine
    that failed, different prompts, a squeezed run that moved nothing) and the one ``publishable``
    flag every reader checks."""
    return {**report, "publishable": verdict.publishable and not problems, "allow_noisy": allow_noisy,
            "quiet": verdict.to_dict(), "problems": list(problems)}


def comparison_problems(errors: dict[str, str], same_prompt: bool) -> list[str]:
    """Why a comparison of engines does not stand: one failed, or they ran different prompts."""
    out = [f"{kind} failed" for kind in errors]
    return out + ([] if same_prompt else ["the engines ran different prompt ids: not like for like"])


def incomplete(pending: Sequence[str]) -> list[str]:
    """The problem of a raw file written while ``pending`` engines have not run yet (none: none)."""
    return [f"incomplete: {', '.join(pending)} not run yet"] if pending else []


def write(out_dir: Path, stem: str, report: dict[str, Any], markdown: str | None = None) -> Path:
    """Write ``<out_dir>/<stem>.json`` (and the markdown summary beside it); return the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    _replace(path, json.dumps(jsonable(report), indent=2) + "\n")
    if markdown is not None:
        note = "" if report.get("publishable", True) else \
            "\n**Not publishable**: see `problems` and `quiet` (runs that were not quiet) in the raw file.\n"
        _replace(path.with_suffix(".md"), f"{markdown}{note}\nRaw file: `{path.name}`\n")
    return path


def _replace(path: Path, text: str) -> None:
    """``path`` holds ``text``, or what it held before: a run stopped while it rewrites its file
    leaves a whole one."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def refuse_if_problems(problems: Sequence[str], path: Path) -> None:
    """Raise ``EdgeInferError`` naming what keeps the figures in ``path`` from standing, if anything does."""
    if problems:
        raise EdgeInferError(f"the figures in {path} do not stand: " + "; ".join(problems))
