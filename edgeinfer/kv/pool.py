"""Block pool and block tables: plain bookkeeping, no torch; and the KV tensors.

``BlockPool`` hands out fixed-size blocks with reference counts (a block shared by a
cached prefix has several owners). It follows a check-then-do protocol:
``can_allocate(n)`` answers without side effects, ``allocate(n)`` either succeeds whole
or raises and changes nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from edgeinfer.errors import CapacityError


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise CapacityError(f"KV pool has {len(self._free)} free blocks, {n} needed")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, block: int) -> None:
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is free and cannot be shared")
        self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]


@dataclass(slots=True)
class BlockTable:
    """The blocks one sequence owns, in order, and how many tokens they hold."""

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def blocks_needed(self, new_tokens: int) -> int:
        capacity = len(self.blocks) * self.block_size
        return max(0, -(-(self.num_tokens + new_tokens - capacity) // self.block_size))

    def slots(self, start: int, count: int) -> list[int]:
        """Flat pool slots of tokens ``start .. start+count-1``."""
        bs = self.block_size
        return [self.blocks[i // bs] * bs + i % bs for i in range(start, start + count)]


class KVCache:
    """The device tensors of the pool: k and v, [layers, blocks, block_size, kv_heads, head_dim].

    Allocated once and zeroed (padding slots read through a block table must be finite).
    Backends receive them by reference; ``write`` puts a step's new K/V at their slots.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @property
    def bytes_per_block(self) -> int:
        per = self.k[:, 0].numel() * self.k.element_size()
        return 2 * per

    def write(self, slots: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """new_k/new_v [layers, B, T, kvh, hd]; slots [B*T] flat slot indices."""
        layers = self.k.shape[0]
        flat_k = self.k.view(layers, -1, *self.k.shape[3:])
        flat_v = self.v.view(layers, -1, *self.v.shape[3:])
        flat_k[:, slots] = new_k.reshape(layers, -1, *new_k.shape[3:])
        flat_v[:, slots] = new_v.reshape(layers, -1, *new_v.shape[3:])
