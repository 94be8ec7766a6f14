"""Eviction policies: which cached blocks of a tier leave first.

A policy only orders keys; it never moves data. The KV manager keeps one policy per
tier, holding the blocks that may leave it (idle blocks on the device; everything on the
host and the disk that no transfer is using).

Contract of :class:`EvictionPolicy`:

- ``insert(key, now, priority)`` makes ``key`` a candidate (an access at step ``now``);
  inserting a present key updates its priority and counts as an access.
- ``touch(key, now)`` records an access; unknown keys are ignored.
- ``remove(key)`` withdraws a candidate; unknown keys are ignored.
- ``evict(n, now)`` is atomic: it returns exactly ``n`` keys, lowest priority first, and
  withdraws them; or, when fewer than ``n`` are candidates, returns ``[]`` and changes
  nothing.

Priorities: :attr:`Priority.IDLE` (prefix-cache entries, finished sessions) leaves before
:attr:`Priority.PREEMPTED` (blocks of a preempted sequence that will be restored).
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable

from edgeinfer.errors import ProfileError


class Priority(enum.IntEnum):
    IDLE = 0
    PREEMPTED = 1


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def insert(self, key: Hashable, now: int, priority: Priority = Priority.IDLE) -> None: ...

    @abstractmethod
    def touch(self, key: Hashable, now: int) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def evict(self, n: int, now: int) -> list[Hashable]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: Hashable) -> bool: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first, within the lowest priority."""

    name = "lru"

    def __init__(self) -> None:
        self._queues: dict[Priority, OrderedDict[Hashable, None]] = {p: OrderedDict() for p in Priority}
        self._priority: dict[Hashable, Priority] = {}

    def insert(self, key: Hashable, now: int, priority: Priority = Priority.IDLE) -> None:
        self.remove(key)
        self._queues[priority][key] = None
        self._priority[key] = priority

    def touch(self, key: Hashable, now: int) -> None:
        if key in self._priority:
            self._queues[self._priority[key]].move_to_end(key)

    def remove(self, key: Hashable) -> None:
        priority = self._priority.pop(key, None)
        if priority is not None:
            del self._queues[priority][key]

    def evict(self, n: int, now: int) -> list[Hashable]:
        if n > len(self._priority):
            return []
        out: list[Hashable] = []
        for priority in Priority:
            queue = self._queues[priority]
            while queue and len(out) < n:
                key, _ = queue.popitem(last=False)
                del self._priority[key]
                out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._priority)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._priority


class LRUKPolicy(EvictionPolicy):
    """LRU-K (O'Neil et al.): evict the largest backward K-distance first.

    Each key keeps its last ``k`` access steps. A key with fewer than ``k`` accesses
    inside the history window (``window`` steps) has an infinite K-distance and goes
    first, oldest last access first: a block read once (a one-off question) leaves
    before a block read twice (a shared system prompt, an image asked about again).
    Histories of withdrawn keys are kept for ``window`` steps, so a block that is
    spilled and brought back remembers its past.
    """

    name = "lru-k"

    def __init__(self, k: int = 2, window: int = 4096) -> None:
        if k < 1 or window < 1:
            raise ValueError(f"k={k} and window={window} must be >= 1")
        self.k = k
        self.window = window
        self._history: dict[Hashable, list[int]] = {}  # candidates: last k access steps, newest last
        self._priority: dict[Hashable, Priority] = {}
        self._retired: OrderedDict[Hashable, list[int]] = OrderedDict()  # withdrawn keys' histories

    def _access(self, key: Hashable, now: int) -> None:
        times = self._history[key]
        times.append(now)
        del times[:-self.k]

    def insert(self, key: Hashable, now: int, priority: Priority = Priority.IDLE) -> None:
        if key not in self._history:
            self._history[key] = self._retired.pop(key, [])
        self._priority[key] = priority
        self._access(key, now)

    def touch(self, key: Hashable, now: int) -> None:
        if key in self._history:
            self._access(key, now)

    def remove(self, key: Hashable) -> None:
        times = self._history.pop(key, None)
        if times is not None:
            del self._priority[key]
            self._retired[key] = times

    def _rank(self, key: Hashable, now: int) -> tuple[int, int, int]:
        """Sort key, smallest leaves first: priority, then K-distance (infinite first), then age."""
        times = self._history[key]
        recent = [t for t in times if t > now - self.window]
        if len(recent) < self.k:
            return (self._priority[key], 0, times[-1] if times else -1)
        return (self._priority[key], 1, recent[-self.k])

    def evict(self, n: int, now: int) -> list[Hashable]:
        if n > len(self._history):
            return []
        victims = heapq.nsmallest(n, self._history, key=lambda key: self._rank(key, now))
        for key in victims:
            self.remove(key)
        self._forget(now)
        return victims

    def _forget(self, now: int) -> None:
        """Drop withdrawn keys' histories older than the window (oldest first, at most 4x window kept)."""
        while self._retired:
            times = next(iter(self._retired.values()))
            if times and times[-1] > now - self.window and len(self._retired) <= 4 * self.window:
                break
            self._retired.popitem(last=False)

    def __len__(self) -> int:
        return len(self._history)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._history


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUKPolicy.name: LRUKPolicy,
    LRUPolicy.name: LRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy from the registry; an unknown name is a profile error listing the valid ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ProfileError(f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}",
                           field="kv.policy") from None
