"""How the paged attention kernel splits a context: plain arithmetic, checked without Triton."""

from __future__ import annotations

import pytest

from edgeinfer.backends.torch.decode_attention import TILING, AttentionTiling


@pytest.mark.parametrize("rows,kv_heads,positions,chunk", [
    (1, 2, 2048, 128),   # one row: the shortest splits
    (16, 2, 2048, 128),  # 16 rows: 32 splits of 64 would fill the target; a split reads whole steps of 128
    (64, 2, 2048, 256),  # 64 rows: 8 splits of 256 fill it
    (1, 2, 40, 128),     # a short context: one split
])
def test_attention_chunk_lengthens_splits_as_rows_grow(rows, kv_heads, positions, chunk):
    assert TILING.chunk_for(rows, kv_heads, positions) == chunk


def test_a_split_takes_whole_steps_of_its_own_tiling():
    """Fewer programs aimed at: 16 rows of 2 KV heads over 2,048 positions take 4 splits of 512
    (steps of 64), not the default's 16 of 128."""
    assert AttentionTiling(tile=64, chunk=64, programs=128).chunk_for(16, 2, 2048) == 512


@pytest.mark.parametrize("given,named", [(dict(tile=8), "at least 16"), (dict(tile=96), "power of two"),
                                         (dict(warps=0), "must be positive"), (dict(registers=300), "24 to 255")])
def test_a_tiling_the_kernel_cannot_run_is_refused(given, named):
    with pytest.raises(ValueError, match=named):
        AttentionTiling(**given)
