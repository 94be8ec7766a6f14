"""The host tier: encoded blocks in host memory, in slots of ``codec.nbytes`` bytes.

Slots live in chunks allocated when first used and released when their last slot is
freed, so an empty host tier holds no memory and a shrinking one gives memory back.
On a discrete GPU the chunks are pinned, so a spill or a restore is one DMA. Slot
bookkeeping (``reserve`` / ``release``) runs on the manager's thread; the spill worker
only reads and writes the bytes of slots it was given.
"""

from __future__ import annotations

import heapq

import torch


class HostStore:
    def __init__(self, capacity: int, nbytes: int, pin: bool = False, chunk_slots: int = 64) -> None:
        self.capacity = max(0, capacity)
        self.nbytes = nbytes
        self.pin = pin
        self.chunk_slots = max(1, chunk_slots)
        self._free: list[int] = list(range(self.capacity))  # a heap: lowest slot first keeps chunks dense
        self._in_use: set[int] = set()
        self._chunks: dict[int, torch.Tensor] = {}
        self._chunk_used: dict[int, int] = {}

    @property
    def writable(self) -> bool:
        """A host tier always takes blocks while it has free slots (the disk tier may stop)."""
        return True

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_allocated(self) -> int:
        return sum(c.numel() for c in self._chunks.values())

    def reserve(self) -> int | None:
        """A free slot, its chunk allocated; None when the tier is full."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        chunk = slot // self.chunk_slots
        if chunk not in self._chunks:
            rows = min(self.chunk_slots, self.capacity - chunk * self.chunk_slots)
            self._chunks[chunk] = torch.empty((rows, self.nbytes), dtype=torch.uint8, pin_memory=self.pin)
            self._chunk_used[chunk] = 0
        self._chunk_used[chunk] += 1
        self._in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        chunk = slot // self.chunk_slots
        if slot not in self._in_use:
            raise ValueError(f"host slot {slot} is not in use")
        self._in_use.discard(slot)
        heapq.heappush(self._free, slot)
        self._chunk_used[chunk] -= 1
        if self._chunk_used[chunk] == 0:
            del self._chunks[chunk], self._chunk_used[chunk]

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes ``[nbytes]`` (uint8), to read or write in place."""
        return self._chunks[slot // self.chunk_slots][slot % self.chunk_slots]
