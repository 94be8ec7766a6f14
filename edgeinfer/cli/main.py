"""The ``edgeinfer`` command: one Typer app; each command group lives in its own module."""

from __future__ import annotations

import typer

from edgeinfer.cli.errors import JsonErrorsGroup

app = typer.Typer(
    name="edgeinfer",
    cls=JsonErrorsGroup,
    help="Answer questions about images on Jetson, CUDA GPUs and CPUs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _quiet_libraries() -> None:
    """Answer questions about images on Jetson, CUDA GPUs and CPUs."""
    # transformers warns on every load that torchvision is absent and it uses its PIL
    # image processors; that is the supported path here, not news for a shell user.
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# Command registration: one line per command module.
from edgeinfer.cli.profiles import profiles_app  # noqa: E402

app.add_typer(profiles_app, name="profiles")
from edgeinfer.cli.doctor import doctor  # noqa: E402

app.command("doctor")(doctor)
from edgeinfer.cli.run import run  # noqa: E402

app.command("run")(run)
from edgeinfer.cli.serve import serve  # noqa: E402

app.command("serve")(serve)

from edgeinfer.cli.build import build  # noqa: E402

app.command("build")(build)
from edgeinfer.cli.bench import bench_app  # noqa: E402

app.add_typer(bench_app, name="bench")
from edgeinfer.cli.cache import cache_app  # noqa: E402

app.add_typer(cache_app, name="cache")
from edgeinfer.cli.quantize import quantize  # noqa: E402

app.command("quantize")(quantize)


if __name__ == "__main__":
    app()
