"""Tile choices by whole-step time: each product's tile timed inside the decode step it runs in.

A product's tile is first chosen alone (:meth:`~.triton_decode.FusedDecode.tune`: every layer's
weight of that product back to back). In the step the kernel before a product is another one:
the attention, a smaller product, a split product's last program. With dependent launches a
kernel reads its first weights while that one drains, so how a tile overlaps its neighbour
counts as much as its own time: the fastest tile alone is not always the fastest in the step.

:func:`descend` changes one product's tile at a time, keeps a change only where the whole step
gets faster, and goes round the products again where a round changed something and time is
left. It tries each product's :data:`STEP_CANDIDATES` fastest tiles alone: on the H200 the tile a
whole step kept was always among the seven fastest alone, and trying fewer tiles leaves time for
a third round within the load's budget.
"""

from __future__ import annotations

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
# The tiles tried in the step: each product's fastest this many alone, for this many rounds.
STEP_CANDIDATES = 8
STEP_ROUNDS = 3


@dataclass
class Descent:
    """What :func:`descend` found: the choices it started from and the ones it kept, the step's
    time with each, the trials it timed, and whether it stopped for its time budget."""
    start: dict[str, Hashable]
    choices: dict[str, Hashable]
    start_us: float
    best_us: float
    trials: int = 0
    rounds: int = 0
    out_of_time: bool = False

    @property
    def changed(self) -> dict[str, tuple[Hashable, Hashable]]:
        """name -> (tile it started from, tile kept) for every product whose tile differs at the end
        (a product changed and later changed back is not among them)."""
        return {name: (self.start[name], tile) for name, tile in self.choices.items() if tile != self.start[name]}


def descend(start: Mapping[str, Hashable], candidates: Mapping[str, Sequence[Hashable]],
            step_us: Callable[[dict[str, Hashable]], float], budget_s: float, rounds: int = STEP_ROUNDS,
            clock: Callable[[], float] = time.monotonic) -> Descent:
    """Coordinate descent over the products' tiles by whole-step time.

    ``start``: a tile per product (the choices made alone); ``candidates``: each product's
    tiles in the order to try them (the most promising first); ``step_us(choices)``: the
    step's time with those tiles. A tile replaces the current one where it makes the step at
    least :data:`MIN_GAIN` faster. Stops after ``rounds`` rounds, after a round that changed
    nothing, or once ``budget_s`` seconds have passed (the best found so far is kept)."""
    started = clock()
    best = dict(start)
    start_us = step_us(dict(best))
    result = Descent(start=dict(start), choices=best, start_us=start_us, best_us=start_us)
    for _ in range(rounds):
        result.rounds += 1
        improved = False
        for name, tiles in candidates.items():
            for tile in tiles:
                if tile == best[name]:
                    continue
                if clock() - started > budget_s:
                    result.out_of_time = True
                    return result
                t = step_us({**best, name: tile})
                result.trials += 1
                if t < result.best_us * (1 - MIN_GAIN):
                    best[name] = tile
                    result.best_us = t
                    improved = True
        if not improved:
            break
    return result


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
