"""Tile choices by whole-step time: each product's tile timed inside the decode step it runs in.

A product's tile is first chosen alone (:meth:`~.triton_decode.FusedDecode.tune`: every layer's
weight of that product back to back). In the step the kernel before a product is another one:
the attention, a smaller product, a split product's last program. With dependent launches a
kernel reads its first weights while that one drains, so how a tile overlaps its neighbour
counts as much as its own time: the fastest tile alone is not always the fastest in the step.

:func:`descend` tries every product's other tiles, one change at a time from the tiles kept,
and then takes the one change that made the whole step fastest (steepest descent), for as many
rounds as changes it may make. It tries each product's :data:`STEP_CANDIDATES` fastest tiles
alone: on the H200 the tile a whole step kept has always been among the eight fastest alone.

Taking the first change that helped, product by product in a fixed order, ended where that
order and the trials near the line led: on the H200's Qwen2-VL-2B shape, at one of two sets of
tiles 5% apart, each one change from the tiles chosen alone. Where ``o``'s change came first,
``down``'s split tile no longer helped, and the step stayed at 946 µs; ``down``'s change alone
gives 899 µs (``scripts/probe_step_tuning.py`` runs the descents again and again in one process).

A trial that beats the kept time is timed once more, and the kept tiles once more beside it, and
is taken only where the mean of its two timings still beats the mean of the kept tiles' timings
(the start is timed twice): the fastest of a round's trials is the one most likely to have been
timed low by luck.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from edgeinfer.quant.kernels import replay_ms

# Below this share of a step, a faster time is taken for the timing's own spread.
MIN_GAIN = 0.003
# The past each timed step reads, in blocks of this many positions: a picture's prompt.
STEP_TUNING_CONTEXT = 1024
STEP_TUNING_BLOCK = 16
# The tiles tried in the step: each product's fastest this many alone; at most this many changes.
STEP_CANDIDATES = 8
STEP_ROUNDS = 3


@dataclass
class Descent:
    """What :func:`descend` found: the choices it started from and the ones it kept, the step's
    time with each (means of timings), the trials it timed, how many of them beat the kept time
    once but not when timed again (``refuted``), and whether it stopped for its time budget."""
    start: dict[str, Hashable]
    choices: dict[str, Hashable]
    start_us: float
    best_us: float
    trials: int = 0
    refuted: int = 0
    rounds: int = 0
    out_of_time: bool = False

    @property
    def changed(self) -> dict[str, tuple[Hashable, Hashable]]:
        """name -> (tile it started from, tile kept) for every product whose tile differs at the end
        (a product changed and later changed back is not among them)."""
        return {name: (self.start[name], tile) for name, tile in self.choices.items() if tile != self.start[name]}

    def report(self, context: int, seconds: float) -> dict:
        """What the raw file says of it: the past the step was timed over, the step's time at the
        start and at the end, the trials, refuted, rounds, whether time ran out, and its ``seconds``."""
        return {"context": context, "alone_us": round(self.start_us, 1), "in_step_us": round(self.best_us, 1),
                "trials": self.trials, "refuted": self.refuted, "rounds": self.rounds,
                "out_of_time": self.out_of_time, "seconds": round(seconds, 1)}


def descend(start: Mapping[str, Hashable], candidates: Mapping[str, Sequence[Hashable]],
            step_us: Callable[[dict[str, Hashable]], float], budget_s: float, rounds: int = STEP_ROUNDS,
            clock: Callable[[], float] = time.monotonic) -> Descent:
    """Steepest descent over the products' tiles by whole-step time, one change a round.

    ``start``: a tile per product (the choices made alone); ``candidates``: each product's
    tiles; ``step_us(choices)``: one timing of the step with those tiles. A round times every
    product's other tiles, each with the other products' tiles as kept, and takes the fastest
    trial where it is at least :data:`MIN_GAIN` below the kept tiles' time: timed once more, and
    the kept tiles once more beside it, the mean of its two timings must still be that much
    below the mean of the kept tiles' timings (the start is timed twice). Stops after ``rounds``
    rounds, after a round that changed nothing, or once ``budget_s`` seconds have passed; a
    round cut short by the budget still takes its fastest trial so far, so checked."""
    started = clock()
    best = dict(start)
    kept = [step_us(dict(best)), step_us(dict(best))]  # the kept tiles' timings
    result = Descent(start=dict(start), choices=best, start_us=statistics.mean(kept), best_us=statistics.mean(kept))
    for _ in range(rounds):
        result.rounds += 1
        fastest: tuple[float, str, Hashable] | None = None
        for name, tiles in candidates.items():
            for tile in tiles:
                if tile == best[name]:
                    continue
                if clock() - started > budget_s:
                    result.out_of_time = True
                    break
                t = step_us({**best, name: tile})
                result.trials += 1
                if fastest is None or t < fastest[0]:
                    fastest = (t, name, tile)
            if result.out_of_time:
                break
        changed = fastest is not None and fastest[0] < result.best_us * (1 - MIN_GAIN) and \
            _confirm(result, best, kept, fastest, step_us)
        if result.out_of_time or not changed:
            break
    return result


def _confirm(result: Descent, best: dict[str, Hashable], kept: list[float], trial: tuple[float, str, Hashable],
             step_us: Callable[[dict[str, Hashable]], float]) -> bool:
    """Times ``trial`` (its timing, product, tile) again and the kept tiles again beside it; takes
    the tile into ``best`` where the mean of its two timings is still :data:`MIN_GAIN` below the
    kept tiles' mean. Updates ``kept`` and the result's time either way."""
    t, name, tile = trial
    again = [t, step_us({**best, name: tile})]
    kept.append(step_us(dict(best)))
    taken = statistics.mean(again) < statistics.mean(kept) * (1 - MIN_GAIN)
    if taken:
        best[name] = tile
        kept[:] = again
    else:
        result.refuted += 1
    result.best_us = statistics.mean(kept)
    return taken


def step_time_us(step: Callable[[], object], steps_a_graph: int = 2, min_replay_s: float = 0.02) -> float:
    """Device microseconds of one ``step()``, replayed from a CUDA graph of ``steps_a_graph`` steps
    (as the engine's bursts replay them, one step's kernels right behind the last one's), as
    many replays as take ``min_replay_s`` (three at least): the same time share on a Jetson as
    on an H200."""
    step()  # outside the capture: whatever the kernels size lazily is sized here
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps_a_graph):
            step()
    first = replay_ms(graph, 1)
    replays = max(3, int(min_replay_s * 1e3 / max(first, 1e-3)))
    return replay_ms(graph, replays) / steps_a_graph * 1e3
