"""The one pool-size rule: how many KV blocks a device budget holds."""

from __future__ import annotations


def block_bytes(layers: int, block_size: int, kv_size: int, dtype_bytes: int) -> int:
    """Bytes of one block of the K and the V pool together, over all layers."""
    return 2 * layers * block_size * kv_size * dtype_bytes


def pool_blocks(budget_mb: int, bytes_per_block: int, configured: int | None = None) -> int:
    """Device KV blocks: the configured count, else as many blocks as the budget holds (at least 4)."""
    return configured or max(4, budget_mb * 2**20 // bytes_per_block)
