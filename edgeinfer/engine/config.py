"""The engine's one config object: built once from a device profile (+ overrides), frozen."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from edgeinfer.kv.disk import default_cache_dir
from edgeinfer.kv.manager import KVManagerConfig
from edgeinfer.kv.sizing import block_bytes, pool_blocks
from edgeinfer.profiles import STEP_TUNING_S, parse_size

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs to size itself; built once from a profile (+ overrides)."""

    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_budget_mb and the model's bytes per block
    kv_budget_mb: int = 512
    max_batch_size: int = 8
    prefill_chunk: int = 512
    max_context: int = 8192
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    vision_cache_entries: int = 16
    available_floor_mb: int = 0
    cuda_graphs: bool = False
    # Greedy decode steps replayed back to back between trips to the host (CUDA graphs only).
    decode_burst: int = 16
    # CUDA graphs: the decode step as fused Triton kernels where Triton is installed.
    fused_decode: bool = True
    # CUDA graphs: prompt-length buckets whose batch-1 prefill graphs are kept (0: prefill eagerly).
    prefill_graphs: int = 8
    # CUDA graphs: seconds of load spent capturing every decode graph the buckets allow, and a prompt's
    # first chunk per length bucket (0: on first use).
    capture_budget_s: float = 0.0
    # CUDA graphs, fused step: seconds of load spent choosing its tiles by the whole step's time
    # after choosing them product by product (0: product by product only).
    step_tuning_s: float = STEP_TUNING_S
    # Image sizes (width, height) the torch vision tower is compiled for at load (CUDA only).
    vision_compile_sizes: tuple[tuple[int, int], ...] = ()
    profile_name: str = "custom"
    # KV tiers (profile: kv.* and memory.*). Sizes 0 turn a tier off; a bare config has none.
    host_precision: str = "full"
    host_tier_mb: int = 0
    disk_tier_mb: int = 0
    disk_dir: str | None = None  # None: $XDG_CACHE_HOME/edgeinfer/kv
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    kv_policy: str = "lru-k"
    prefix_cache: bool = True
    unified_memory: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for name in ("block_size", "max_batch_size", "prefill_chunk", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.step_tuning_s < 0:
            raise ValueError(f"step_tuning_s must be >= 0, not {self.step_tuning_s}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def captures_at_start(self) -> bool:
        """Whether a load captures graphs at start-up (``Engine.capture_graphs``): CUDA graphs on a
        GPU with a capture budget. After those captures live traffic compiles nothing new."""
        return self.cuda_graphs and self.capture_budget_s > 0 and self.device.startswith("cuda")

    def device_blocks(self, decoder_cfg) -> int:
        """The KV pool's length for a decoder of ``decoder_cfg``: the configured count, else the
        budget over one block's bytes (the one rule, in ``kv.sizing``)."""
        bytes_per_block = block_bytes(decoder_cfg.kv_layers, self.block_size, decoder_cfg.kv_size,
                                      self.torch_dtype.itemsize)
        return pool_blocks(self.kv_budget_mb, bytes_per_block, self.num_blocks)

    def kv_manager_config(self) -> KVManagerConfig:
        return KVManagerConfig(
            host_precision=self.host_precision, host_tier_mb=self.host_tier_mb, disk_tier_mb=self.disk_tier_mb,
            disk_dir=self.disk_dir, high_watermark=self.high_watermark, low_watermark=self.low_watermark,
            available_floor_mb=self.available_floor_mb, policy=self.kv_policy, prefix_cache=self.prefix_cache,
            pin_host=self.device.startswith("cuda") and not self.unified_memory and torch.cuda.is_available())

    def grown_by(self, saved_bytes: int) -> "EngineConfig":
        """This config with the KV budget grown by ``saved_bytes``: what low-bit weights kept packed
        save against the dense model a profile's memory plan leaves room for. A configured block
        count stays as it is."""
        if self.num_blocks is not None or saved_bytes < 2**20:
            return self
        return replace(self, kv_budget_mb=self.kv_budget_mb + saved_bytes // 2**20)

    @classmethod
    def from_profile(cls, profile) -> "EngineConfig":
        return cls(
            block_size=profile.kv.block_size,
            num_blocks=profile.kv.device_blocks,
            kv_budget_mb=profile.memory.kv_device_budget_mb,
            max_batch_size=profile.runtime.max_batch_size,
            prefill_chunk=profile.runtime.prefill_chunk_tokens,
            max_context=profile.runtime.max_context_tokens,
            dtype=profile.runtime.dtype,
            device=profile.runtime.device,
            threads=profile.runtime.threads,
            available_floor_mb=profile.memory.available_floor_mb,
            cuda_graphs=profile.runtime.cuda_graphs,
            prefill_graphs=profile.runtime.prefill_graphs,
            capture_budget_s=profile.runtime.capture_budget_s,
            step_tuning_s=profile.runtime.step_tuning_s,
            vision_compile_sizes=tuple(parse_size(v) for v in profile.runtime.vision_compile_sizes),
            profile_name=profile.name,
            host_precision=profile.kv.host_precision,
            host_tier_mb=profile.memory.host_tier_mb,
            disk_tier_mb=profile.memory.disk_tier_mb,
            disk_dir=profile.kv.disk_dir or str(default_cache_dir()),
            high_watermark=profile.memory.high_watermark,
            low_watermark=profile.memory.low_watermark,
            kv_policy=profile.kv.policy,
            unified_memory=profile.memory.unified,
        )
