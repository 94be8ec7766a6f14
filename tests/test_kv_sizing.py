"""The one pool-size rule, from a profile and inside the engine."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.kv.pool import KVCache
from edgeinfer.kv.sizing import MIN_POOL_BLOCKS, block_bytes, pool_blocks
from edgeinfer.profiles import load_profile


def test_block_bytes_count_k_and_v_of_every_layer():
    cache = KVCache(num_layers=3, num_blocks=4, block_size=16, kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert block_bytes(3, 16, 2 * 8, 2) == cache.bytes_per_block == 2 * 3 * 16 * 16 * 2


def test_device_blocks_derive_from_the_profile_budget():
    profile = load_profile("cpu")
    budget = profile.memory.kv_device_budget_mb
    assert pool_blocks(budget, 2**20, profile.kv.device_blocks) == budget
    explicit = load_profile("cpu", ["kv.device_blocks=7"])
    assert pool_blocks(explicit.memory.kv_device_budget_mb, 2**20, explicit.kv.device_blocks) == 7


def test_a_budget_too_small_for_one_block_still_gives_the_floor():
    assert pool_blocks(1, 2**30) == MIN_POOL_BLOCKS == 4
    assert pool_blocks(1, 2**30, configured=2) == 2  # an explicit count is taken as it is


def test_a_pool_of_no_blocks_is_refused_with_the_number():
    with pytest.raises(ValueError, match="0 blocks"):
        pool_blocks(512, 2**20, configured=0)


def test_the_engine_allocates_the_pool_the_rule_gives(checkpoint):
    from edgeinfer.engine import Engine, EngineConfig

    engine = Engine.load(checkpoint("smolvlm"), config=EngineConfig(kv_budget_mb=1, block_size=4))
    cfg = engine.model.decoder.cfg
    per_block = block_bytes(cfg.num_layers, 4, cfg.kv_size, torch.float32.itemsize)
    assert engine.pool.num_blocks == pool_blocks(1, per_block) == max(4, 2**20 // per_block)
    assert engine.kv.bytes_per_block == per_block
