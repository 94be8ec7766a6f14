"""The one pool-size rule: how many device KV blocks a budget buys.

Every caller that needs the device pool's length (the engine that allocates it, the
TensorRT build that bakes it into an engine's shapes, the staleness check that compares
the two) asks here, so the pool a profile builds for is the pool the engine runs.
"""

from __future__ import annotations

MIN_POOL_BLOCKS = 4


def block_bytes(layers: int, block_size: int, kv_size: int, dtype_bytes: int) -> int:
    """Bytes one block takes on the device: K and V, ``kv_size`` (kv heads x head dim) values per
    token per layer."""
    return 2 * layers * block_size * kv_size * dtype_bytes


def pool_blocks(budget_mb: int, bytes_per_block: int, configured: int | None = None) -> int:
    """Device KV blocks: ``configured`` when given, else the budget over one block's bytes, never
    fewer than :data:`MIN_POOL_BLOCKS`.

    The floor is 4, not 1: 4 is what the engine has always allocated under a budget too small
    for its model, so no running pool changes size; and a pool of one block cannot hold a
    prompt that crosses a block boundary together with the block its first answer token
    needs, so a floor of 1 would only move the failure from load time to the first request.
    An explicit ``configured`` count is taken as it is (a test or a profile asking for a
    pool that small means it).
    """
    if configured is not None:
        if configured < 1:
            raise ValueError(f"a KV pool of {configured} blocks was configured; it must have >= 1")
        return configured
    if bytes_per_block < 1:
        raise ValueError(f"a KV block of {bytes_per_block} bytes; it must have >= 1")
    return max(MIN_POOL_BLOCKS, budget_mb * 2**20 // bytes_per_block)


def blocks_outside_window(num_tokens: int, block_size: int, window: int) -> int:
    """Leading blocks of a sequence of ``num_tokens`` tokens that a sliding layer (Gemma 3)
    never reads again: its next query, token ``num_tokens``, sees keys from token
    ``num_tokens - window + 1`` on, and later queries see less of the past."""
    return max(0, (num_tokens - window + 1) // block_size)


def sliding_window_saving(num_tokens: int, block_size: int, window: int, sliding_layers: int, layers: int) -> float:
    """Share of a sequence's KV bytes held only for sliding layers that will not read them: what a
    pool that frees a sliding layer's blocks once they leave its window would save. The pool
    here keeps every layer of a block together, so these blocks stay allocated; the decoder
    masks them out of the sliding layers' attention."""
    blocks = -(-num_tokens // block_size)
    if not blocks:
        return 0.0
    return blocks_outside_window(num_tokens, block_size, window) * sliding_layers / (blocks * layers)
