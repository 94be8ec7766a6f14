"""The one pool-size rule: how many KV blocks a device budget holds."""

from __future__ import annotations


def block_bytes(layers: int, block_size: int, kv_size: int, dtype_bytes: int) -> int:
    """Bytes of one block of K and V over every layer (``kv_size`` = kv_heads × head_dim)."""
    return 2 * layers * block_size * kv_size * dtype_bytes


def pool_blocks(budget_mb: int, bytes_per_block: int, configured: int | None = None) -> int:
    """Device KV blocks: the configured count, else the budget over one block's bytes (at least 4)."""
    return configured or max(4, budget_mb * 2**20 // bytes_per_block)
