"""The paged KV cache: block pool (mechanism), prefix cache, tiers, eviction policy and spill worker.

The engine and the scheduler talk to :class:`KVManager` only; the other classes are its
parts. Nothing here imports a backend.
"""

from edgeinfer.kv.embeddings import EmbeddingStore
from edgeinfer.kv.entry import MoveKind, Tier
from edgeinfer.kv.hashing import ImageSpan, image_spans
from edgeinfer.kv.manager import KVManager, KVManagerConfig
from edgeinfer.kv.metrics import KVMetrics, register_kv_metrics
from edgeinfer.kv.policy import POLICIES, EvictionPolicy, make_policy
from edgeinfer.kv.pool import BlockPool, BlockTable, KVCache
from edgeinfer.kv.pressure import MemoryFloor, Watermarks
from edgeinfer.kv.sizing import block_bytes, pool_blocks
from edgeinfer.kv.spill import SpillManager

__all__ = ["POLICIES", "BlockPool", "BlockTable", "EmbeddingStore", "EvictionPolicy", "ImageSpan", "KVCache",
           "KVManager", "KVManagerConfig", "KVMetrics", "MemoryFloor", "MoveKind", "SpillManager", "Tier",
           "Watermarks", "block_bytes", "image_spans", "make_policy", "pool_blocks", "register_kv_metrics"]
