"""How the paged attention kernel splits a context: plain arithmetic, checked without Triton."""

from __future__ import annotations

import pytest

from edgeinfer.backends.torch import triton_decode


@pytest.mark.parametrize("rows,kv_heads,positions,chunk", [
    (1, 2, 2048, 128),   # one row: the shortest splits
    (16, 2, 2048, 128),  # 16 rows: 32 splits of 64 would fill the target; a split reads whole steps of 128
    (64, 2, 2048, 256),  # 64 rows: 8 splits of 256 fill it
    (1, 2, 40, 128),     # a short context: one split
])
def test_attention_chunk_lengthens_splits_as_rows_grow(rows, kv_heads, positions, chunk):
    assert triton_decode.attention_chunk(rows, kv_heads, positions) == chunk
