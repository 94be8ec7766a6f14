"""The paged KV cache: block pool (mechanism), block tables, and the tensors behind them."""

from edgeinfer.kv.pool import BlockPool, BlockTable, KVCache

__all__ = ["BlockPool", "BlockTable", "KVCache"]
