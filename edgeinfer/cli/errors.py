"""The CLI's edge for errors: a typed error ends the command with its exit code from
:data:`edgeinfer.errors.ERROR_MAP`, as one line on stderr, or with ``--json`` as one JSON
object on stdout::

    {"error": {"type": "PreflightError", "code": "image_too_large", "message": "...",
               "exit_code": 2, "detail": {...} or null}}

``code`` is the same machine-readable code the HTTP daemon sends for the error. With
``--json`` an untyped error (a bug) and a usage error (a bad flag, exit 2) are answered in
the same shape; without it a bug keeps its traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from edgeinfer.errors import EdgeInferError, error_code, error_detail, exit_code_for

log = logging.getLogger("edgeinfer.cli")
JSON_FLAG = "--json"
# Click's usage errors (typer.BadParameter and its kin). Newer typer releases carry their own copy of
# Click, so the class is found from typer's public name rather than imported from click.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def error_json(error: BaseException) -> dict[str, Any]:
    message = error.message if isinstance(error, EdgeInferError) else str(error)
    return {"error": {"type": type(error).__name__, "code": error_code(error), "message": message,
                      "exit_code": exit_code_for(error), "detail": error_detail(error)}}


def fail(error: BaseException, as_json: bool) -> NoReturn:
    if as_json:
        typer.echo(json.dumps(error_json(error)))
    else:
        typer.echo(f"error: {error}", err=True)
    raise typer.Exit(exit_code_for(error))


@contextmanager
def cli_errors(as_json: bool = False) -> Iterator[None]:
    """Typed errors end the command with their mapped exit code; with ``as_json`` every error does."""
    try:
        yield
    except (typer.Exit, typer.Abort, ClickException):
        raise  # Click's own ways out: an exit status already chosen, a usage error
    except EdgeInferError as error:
        fail(error, as_json)
    except Exception as error:
        if not as_json:
            raise
        log.error("unhandled %s", type(error).__name__, exc_info=error)
        fail(error, as_json)


def wants_json(args: Sequence[str]) -> bool:
    """Whether the command line asks for JSON (``--json`` before any ``--``)."""
    options = list(args)[:list(args).index("--")] if "--" in args else list(args)
    return JSON_FLAG in options


class JsonErrorsGroup(TyperGroup):
    """The top-level command: with ``--json`` anywhere on the line, Click's usage errors (an unknown
    flag, a bad value) are answered as the same JSON object as every other error."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or not wants_json(argv):
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            status = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as error:
            typer.echo(json.dumps(usage_error_json(error)))
            sys.exit(error.exit_code)
        except typer.Abort:
            sys.exit(1)
        sys.exit(status if isinstance(status, int) else 0)


def usage_error_json(error: Exception) -> dict[str, Any]:
    context = getattr(error, "ctx", None)
    hint = f" (see `{context.command_path} --help`)" if context is not None else ""
    return {"error": {"type": type(error).__name__, "code": "usage_error", "message": error.format_message() + hint,
                      "exit_code": error.exit_code, "detail": None}}
