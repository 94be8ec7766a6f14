"""Summaries of repeated measurements: the median of every run with its range, never the best run."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of all runs, their minimum and maximum, and how many there were."""

    median: float
    min: float
    max: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def spread(values: Iterable[float | None]) -> Spread:
    """Median, minimum and maximum of ``values`` (runs that measured nothing, None, are left out).

    No runs gives NaN figures and ``n == 0``, so a table shows the hole instead of a number.
    """
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return Spread(math.nan, math.nan, math.nan, 0)
    return Spread(statistics.median(kept), min(kept), max(kept), len(kept))


def ratio(ours: float | None, peer: float | None) -> float:
    """``ours / peer``; NaN where either is missing or the peer's figure is zero."""
    if ours is None or peer is None or peer == 0 or math.isnan(ours) or math.isnan(peer):
        return math.nan
    return ours / peer


def rate(tokens: float, seconds: float) -> float | None:
    """Tokens per second, None where no time passed (nothing to divide)."""
    return tokens / seconds if seconds > 0 else None
