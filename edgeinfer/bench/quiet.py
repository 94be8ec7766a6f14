"""Quiet runs: a CPU figure counts only when nothing else was running beside the benchmark.

Every run records ``os.getloadavg()`` before and after it. The load average counts our own
busy threads too (two threads on two cores push it towards 2 within a minute), so the
limit applies to the load of *other* processes: the 1-minute load average minus our own
share of it. Our share is averaged the way the kernel averages load (every few seconds,
``share = share * e + busy * (1 - e)`` with ``e = exp(-dt / 60 s)``), where ``busy`` is the
CPU seconds our process tree (the benchmark and its workers) used per second.

A run is quiet when other processes' load stayed at or under the limit (1.5 by default)
both before and after it. A benchmark on a CPU whose timed runs are not all quiet is not
publishable: its raw file says ``"publishable": false`` and the command exits non-zero,
unless ``--allow-noisy`` asked for the file anyway.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import LimitExceeded

QUIET_LOAD = 1.5  # the default limit on other processes' 1-minute load average
LOAD_WINDOW_S = 60.0  # the 1-minute load average's time constant


def ema_step(share: float, cpu_seconds: float, seconds: float) -> float:
    """Our share of the 1-minute load average after ``seconds`` in which we used ``cpu_seconds``."""
    if seconds <= 0:
        return share
    decay = math.exp(-seconds / LOAD_WINDOW_S)
    return share * decay + (cpu_seconds / seconds) * (1.0 - decay)


def own_cpu_seconds() -> float:
    """CPU seconds used so far by this process and every process it started (live or finished)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # ended between the listing and the reading; its time is now its parent's
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _process_age_s() -> float:
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


class LoadTracker:
    """Our share of the 1-minute load average over time, sampled on a background thread.

    ``share_at(t)`` answers for any wall time ``t`` (``time.time()``) between the first and
    the last sample, so runs timed in a worker process are judged after the worker ends.
    """

    def __init__(self, period_s: float = 2.0, cpu_seconds: Callable[[], float] = own_cpu_seconds,
                 clock: Callable[[], float] = time.time) -> None:
        self.period_s = period_s
        self._cpu_seconds = cpu_seconds
        self._clock = clock
        self._samples: list[tuple[float, float]] = []
        self._last_cpu = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, age_s: float | None = None, cpu_s: float | None = None) -> "LoadTracker":
        """Begin sampling; the first sample counts what this process used since it started."""
        cpu = self._cpu_seconds() if cpu_s is None else cpu_s
        age = _process_age_s() if age_s is None else age_s
        self._last_cpu = cpu
        self._samples.append((self._clock(), ema_step(0.0, cpu, age)))
        self._thread = threading.Thread(target=self._loop, name="bench-load-tracker", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        now, cpu = self._clock(), self._cpu_seconds()
        then, share = self._samples[-1]
        self._samples.append((now, ema_step(share, max(0.0, cpu - self._last_cpu), now - then)))
        self._last_cpu = cpu

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def __enter__(self) -> "LoadTracker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def share_at(self, t: float) -> float:
        """Our share of the load average at wall time ``t``, interpolated between samples."""
        samples = self._samples
        if not samples:
            return 0.0
        if t <= samples[0][0]:
            return samples[0][1]
        for (t0, s0), (t1, s1) in zip(samples, samples[1:]):
            if t <= t1:
                return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else s1
        return samples[-1][1]


class RunLog:
    """The runs of one benchmark, each with the load average before and after it."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    @contextmanager
    def run(self, label: str, timed: bool = True) -> Iterator[dict[str, Any]]:
        """Record one run: the caller fills the yielded dict with its figures. ``timed=False``
        marks a warm-up, whose load is recorded but does not decide publication."""
        record: dict[str, Any] = {"label": label, "timed": timed}
        started, before = time.time(), os.getloadavg()
        yield record
        record["load"] = {"started": started, "ended": time.time(), "before": list(before),
                          "after": list(os.getloadavg())}
        self.records.append(record)


@dataclass(frozen=True, slots=True)
class RunLoad:
    """One run's 1-minute load averages, our share of them, and whether it was quiet."""

    label: str
    load_before: float
    load_after: float
    own_before: float
    own_after: float
    quiet: bool

    @property
    def others(self) -> float:
        """The larger of other processes' load before and after the run."""
        return max(0.0, self.load_before - self.own_before, self.load_after - self.own_after)


def judge_run(record: dict[str, Any], share_at: Callable[[float], float], max_load: float) -> RunLoad:
    load = record["load"]
    own_before, own_after = share_at(load["started"]), share_at(load["ended"])
    others = max(load["before"][0] - own_before, load["after"][0] - own_after)
    return RunLoad(record["label"], load["before"][0], load["after"][0], own_before, own_after,
                   others <= max_load)


@dataclass(frozen=True, slots=True)
class QuietVerdict:
    """Whether a benchmark's figures may be published, and the load of every timed run."""

    enforced: bool  # CPU figures: noisy runs refuse publication; GPU figures only record the load
    max_load: float
    runs: tuple[RunLoad, ...]

    @property
    def noisy(self) -> list[RunLoad]:
        return [r for r in self.runs if not r.quiet]

    @property
    def publishable(self) -> bool:
        return bool(self.runs) and not (self.enforced and self.noisy)

    def to_dict(self) -> dict[str, Any]:
        return {"enforced": self.enforced, "max_load": self.max_load, "publishable": self.publishable,
                "noisy_runs": [r.label for r in self.noisy],
                "worst_others_load": max((r.others for r in self.runs), default=None),
                "runs": [asdict(r) | {"others": r.others} for r in self.runs]}


def judge(records: Sequence[dict[str, Any]], share_at: Callable[[float], float], max_load: float = QUIET_LOAD,
          enforced: bool = True) -> QuietVerdict:
    """Judge every timed run of ``records`` (``RunLog.records``, possibly from several processes)."""
    runs = tuple(judge_run(r, share_at, max_load) for r in records if r.get("timed", True) and "load" in r)
    return QuietVerdict(enforced, max_load, runs)


def refuse_if_noisy(verdict: QuietVerdict, raw_path: Path, allow_noisy: bool) -> None:
    """Raise ``LimitExceeded`` (exit 2) when CPU figures came from noisy runs, unless allowed."""
    if verdict.publishable or allow_noisy or not verdict.enforced:
        return
    if not verdict.runs:
        raise LimitExceeded("timed runs recorded", 0, 1, reason="no_runs")
    worst = max(verdict.noisy, key=lambda r: r.others)
    raise LimitExceeded(
        f"other processes' 1-minute load average around run '{worst.label}' ({len(verdict.noisy)} of "
        f"{len(verdict.runs)} runs over the limit; {raw_path} is marked unpublishable)",
        round(worst.others, 2), verdict.max_load,
        override="rerun on a quiet machine, or --allow-noisy to keep an unpublishable raw file",
        reason="noisy_machine")
