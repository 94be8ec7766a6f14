"""How the paged attention kernel splits a context: plain arithmetic, checked without Triton."""

from __future__ import annotations

import pytest

from edgeinfer.backends.torch import triton_decode


@pytest.mark.parametrize("rows,kv_heads,positions,chunk", [
    (1, 2, 2048, 32),   # one row: the shortest splits
    (16, 2, 2048, 64),  # 16 rows: 32 splits of 64 fill the target
    (64, 2, 2048, 256),
    (1, 2, 40, 32),     # a short context: as many splits as it has chunks
])
def test_attention_chunk_lengthens_splits_as_rows_grow(rows, kv_heads, positions, chunk):
    assert triton_decode.attention_chunk(rows, kv_heads, positions) == chunk
