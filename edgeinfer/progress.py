"""Progress of long work: what library code reports to (:class:`Steps`) and the bars on stderr that draw it.

Library code takes a :class:`Steps` and never draws: a phase starts with its count of steps (None
where it is not known ahead) and hands back the call that marks one done. The commands and the
engine's load draw phases as rich bars on stderr (:func:`stderr_bars`, :class:`RichSteps`), so
that stdout keeps only the answer or the JSON report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class Steps(Protocol):
    """Where progress goes: a phase of ``total`` steps starts (None: not known ahead), then one call
    per step done."""

    def phase(self, description: str, total: int | None) -> Callable[[], None]: ...


class NoSteps:
    def phase(self, description: str, total: int | None) -> Callable[[], None]:
        return lambda: None


class RichSteps:
    """A bar of ``progress`` per phase."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def phase(self, description: str, total: int | None) -> Callable[[], None]:
        task = self.progress.add_task(description, total=total)
        return lambda: self.progress.advance(task)


def stderr_bars(*, transient: bool = False, disable: bool = False) -> Progress:
    """Bars on stderr, each its description, the bar, steps done of all and the time elapsed
    (``transient``: gone when done)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=transient, disable=disable)
