"""The ``edgeinfer`` command: one Typer app; each command group lives in its own module."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="edgeinfer",
    help="Answer questions about images on Jetson, CUDA GPUs and CPUs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

# Command registration: one line per command module.
from edgeinfer.cli.profiles import profiles_app  # noqa: E402

app.add_typer(profiles_app, name="profiles")
from edgeinfer.cli.doctor import doctor  # noqa: E402

app.command("doctor")(doctor)
