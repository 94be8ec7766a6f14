"""``edgeinfer bench``: benchmarks that run a peer in the same run and report ratios of medians.

Each subcommand forwards its arguments to the benchmark module's own parser
(``--help`` after the subcommand lists them).
"""

from __future__ import annotations

import importlib

import typer

bench_app = typer.Typer(help="Benchmarks against transformers' generate() (and other peers), run together.",
                        no_args_is_help=True)

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
BENCHMARKS = {
    "generate": ("edgeinfer.bench.generate", "Time to first token, decode tokens/s and peak RSS on a CPU."),
    "gpu": ("edgeinfer.bench.gpu", "TTFT, decode at several batch sizes, peak memory and roofline on a GPU."),
    "kv": ("edgeinfer.bench.kv", "Session resume from host and disk tiers, spill overhead, round-robin sessions."),
}


def _forwarder(module: str):
    def command(ctx: typer.Context) -> None:
        importlib.import_module(module).main(list(ctx.args))

    return command


for _name, (_module, _help) in BENCHMARKS.items():
    bench_app.command(_name, help=_help, context_settings=_PASS_THROUGH)(_forwarder(_module))
