"""Block pool and block tables: plain bookkeeping, no torch; and the KV tensors.

``BlockPool`` hands out fixed-size blocks with reference counts (a block shared by a
cached prefix has several owners). It follows a check-then-do protocol:
``can_allocate(n)`` answers without side effects, ``allocate(n)`` either succeeds whole
or raises and changes nothing.

A block marked *cached* (its content is a prefix-cache entry) does not become blank
when its last owner frees it: it is *idle*, counted as free, and keeps its content
until the KV manager either revives it (``revive``: a prefix hit) or drops the content
(``uncache``: it moved to another tier or was evicted). ``allocate`` hands out blank blocks only;
which idle block to give up is the eviction policy's choice, not the pool's.
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
        self._cached: set[int] = set()
        self._idle: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks no sequence owns: blank ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_blank(self) -> int:
        """Blocks ``allocate`` can hand out now."""
        return len(self._free)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

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
                (self._idle.add if b in self._cached else self._free.append)(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def mark_cached(self, block: int) -> None:
        """An owned block now holds a prefix-cache entry: freeing it leaves it idle, not blank."""
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is free and cannot be marked cached")
        self._cached.add(block)

    def revive(self, block: int) -> None:
        """Take one more reference to a cached block, idle or owned."""
        if block in self._idle:
            self._idle.discard(block)
            self._refs[block] = 1
        elif block in self._cached and self._refs[block] > 0:
            self._refs[block] += 1
        else:
            raise ValueError(f"block {block} holds no cached content")

    def uncache(self, block: int) -> None:
        """The block's cached content is gone: an idle block becomes blank."""
        self._cached.discard(block)
        if block in self._idle:
            self._idle.discard(block)
            self._free.append(block)


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

    @property
    def device(self) -> torch.device:
        return self.k.device

    def read_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``blocks`` as k, v ``[n, layers, block_size, kv_heads, head_dim]`` (block-major)."""
        return self.k[:, blocks].transpose(0, 1).contiguous(), self.v[:, blocks].transpose(0, 1).contiguous()

    def write_blocks(self, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put block-major ``k, v [n, layers, ...]`` into ``blocks``."""
        self.k[:, blocks] = k.transpose(0, 1).to(self.k.dtype)
        self.v[:, blocks] = v.transpose(0, 1).to(self.v.dtype)

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def write(self, slots: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """new_k/new_v [layers, B, T, kvh, hd]; slots [B*T] flat slot indices."""
        layers = self.k.shape[0]
        flat_k = self.k.view(layers, -1, *self.k.shape[3:])
        flat_v = self.v.view(layers, -1, *self.v.shape[3:])
        flat_k[:, slots] = new_k.reshape(layers, -1, *new_k.shape[3:])
        flat_v[:, slots] = new_v.reshape(layers, -1, *new_v.shape[3:])
