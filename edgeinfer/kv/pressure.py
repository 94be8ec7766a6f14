"""Spill pressure: the profile's rules for when blocks must leave a tier, as pure decisions.

- **Device watermarks.** When more than ``high`` of the pool's blocks hold content
  (running or idle), idle blocks are spilled until ``low`` of it do.
- **Host watermarks.** With a disk to go to, a host tier filled above ``high`` of its
  capacity shrinks to ``low`` of it.
- **Available-memory floor.** While the machine's available memory is under the floor,
  the host tier shrinks by the ``low`` ratio at every check and takes no new spills (on
  unified memory the camera pipeline and the OS share the same DRAM).

Nothing here reads the clock, the machine or a tier, and nothing moves a block: callers
pass counts and readings in and get back how many blocks to move. The KV manager applies
the answers through the spill manager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Fractions of a tier's capacity: spilling starts above ``high`` and stops at ``low``."""

    high: float
    low: float

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low ({self.low}) < high ({self.high}) <= 1")

    def over_high(self, used: int, capacity: int) -> bool:
        return used > self.high * capacity

    def device_excess(self, used: int, capacity: int) -> int:
        """Idle device blocks to spill when ``used`` of ``capacity`` blocks hold content: down to
        ``low`` once above ``high``, else none."""
        return used - math.floor(self.low * capacity) if self.over_high(used, capacity) else 0

    def host_excess(self, used: int, capacity: int, *, floor_breached: bool, has_disk: bool) -> int:
        """Host blocks to push out (to disk, or dropped): ``low`` of what is there while memory is
        under the floor; with a disk to go to, down to ``low`` of capacity once above ``high``."""
        if floor_breached:
            return used - math.floor(self.low * used)
        if has_disk and self.over_high(used, capacity):
            return used - math.floor(self.low * capacity)
        return 0


class MemoryFloor:
    """Available memory against the profile's floor, read at most every ``check_s`` seconds.

    ``due(now)`` says whether a reading is wanted; ``observe(available, now)`` records one
    and says whether memory just went under the floor (the moment to warn once). A floor
    of 0 turns the rule off.
    """

    def __init__(self, floor_mb: int, check_s: float) -> None:
        if floor_mb < 0 or check_s < 0:
            raise ValueError(f"floor_mb={floor_mb} and check_s={check_s} must be >= 0")
        self.floor_mb = floor_mb
        self.check_s = check_s
        self.breached = False
        self._next_check = 0.0

    @property
    def enabled(self) -> bool:
        return self.floor_mb > 0

    def due(self, now: float) -> bool:
        return self.enabled and now >= self._next_check

    def observe(self, available_bytes: int, now: float) -> bool:
        """Record a reading taken at ``now``; True when memory has just gone under the floor."""
        self._next_check = now + self.check_s
        was = self.breached
        self.breached = available_bytes < self.floor_mb * 2**20
        return self.breached and not was
