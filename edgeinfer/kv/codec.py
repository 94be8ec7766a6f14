"""How a block is laid out outside the device pool: one flat byte string per block.

``full`` keeps the pool's own values bit for bit (spilled and restored KV gives the same
tokens). ``int8`` and ``fp8`` (e4m3) keep one scale per block, per layer, per K/V and per
KV head, symmetric around zero; the values are quantized in float32 and the scales are
float32 (no tier keeps fp16: where 16-bit values are kept, as the pool's own bf16 in
``full``, they are stored as they are). Encoding and decoding run where the tensors
are: on a GPU the bytes that cross PCIe are already compressed.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from edgeinfer.errors import ProfileError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def values(self) -> int:
        """Values of K (or of V) in one block."""
        return self.layers * self.block_size * self.kv_heads * self.head_dim

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (self.layers, self.block_size, self.kv_heads, self.head_dim)

    def describe(self) -> str:
        return f"{self.layers}x{self.block_size}x{self.kv_heads}x{self.head_dim}:{str(self.dtype).removeprefix('torch.')}"


class BlockCodec(ABC):
    """Blocks ``k, v [n, layers, block_size, kv_heads, head_dim]`` <-> bytes ``[n, nbytes]`` (uint8)."""

    name: str
    exact: bool

    def __init__(self, geometry: BlockGeometry) -> None:
        self.geometry = geometry

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(x.shape[0], -1).view(torch.uint8)


class FullCodec(BlockCodec):
    name = "full"
    exact = True

    @property
    def nbytes(self) -> int:
        return 2 * self.geometry.values * self.geometry.dtype.itemsize

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat((_as_bytes(k.to(self.geometry.dtype)), _as_bytes(v.to(self.geometry.dtype))), dim=1)

    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, n = self.geometry, payload.shape[0]
        k, v = payload.view(g.dtype).view(n, 2, *g.block_shape).unbind(1)
        return k, v


class ScaledCodec(BlockCodec):
    """Symmetric per-(block, layer, K/V, head) scaling into a narrow type."""

    exact = False
    store_dtype: torch.dtype
    max_value: float

    @property
    def nbytes(self) -> int:
        g = self.geometry
        return 2 * g.values * self.store_dtype.itemsize + 2 * g.layers * g.kv_heads * 4

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        amax = x.abs().amax(dim=(2, 4), keepdim=True)  # [n, layers, 1, kvh, 1]
        scale = (amax / self.max_value).clamp_min(1e-12)
        return self._narrow(x / scale), scale.view(x.shape[0], -1)

    @abstractmethod
    def _narrow(self, x: torch.Tensor) -> torch.Tensor: ...

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qk, sk = self._quantize(k)
        qv, sv = self._quantize(v)
        return torch.cat((_as_bytes(qk), _as_bytes(qv), _as_bytes(sk), _as_bytes(sv)), dim=1)

    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, n = self.geometry, payload.shape[0]
        body = 2 * g.values * self.store_dtype.itemsize
        q = payload[:, :body].contiguous().view(self.store_dtype).view(n, 2, *g.block_shape)
        scales = payload[:, body:].contiguous().view(torch.float32).view(n, 2, g.layers, 1, g.kv_heads, 1)
        out = (q.float() * scales).to(g.dtype)
        return out[:, 0], out[:, 1]


class Int8Codec(ScaledCodec):
    name = "int8"
    store_dtype = torch.int8
    max_value = 127.0

    def _narrow(self, x: torch.Tensor) -> torch.Tensor:
        return x.round().clamp(-127, 127).to(torch.int8)


class Fp8Codec(ScaledCodec):
    name = "fp8"
    max_value = 448.0  # largest finite e4m3 value

    @property
    def store_dtype(self) -> torch.dtype:  # type: ignore[override]
        return torch.float8_e4m3fn

    def _narrow(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-self.max_value, self.max_value).to(torch.float8_e4m3fn)


def fp8_supported(device: torch.device | str = "cpu") -> bool:
    """Whether this torch can convert to and from e4m3 on ``device``."""
    if not hasattr(torch, "float8_e4m3fn"):
        return False
    try:
        x = torch.tensor([1.5, -3.0], device=device).to(torch.float8_e4m3fn)
        return bool(torch.equal(x.view(torch.uint8).view(torch.float8_e4m3fn).float().cpu(),
                                torch.tensor([1.5, -3.0])))
    except (RuntimeError, TypeError):
        return False


CODECS: dict[str, Callable[[BlockGeometry], BlockCodec]] = {
    FullCodec.name: FullCodec,
    Int8Codec.name: Int8Codec,
    Fp8Codec.name: Fp8Codec,
}


def make_codec(name: str, geometry: BlockGeometry, device: torch.device | str = "cpu") -> BlockCodec:
    """The codec ``name``; ``fp8`` where torch lacks e4m3 on ``device`` falls back to ``int8``, with a warning."""
    if name not in CODECS:
        raise ProfileError(f"unknown host precision {name!r}; valid: {', '.join(sorted(CODECS))}",
                           field="kv.host_precision")
    if name == Fp8Codec.name and not fp8_supported(device):
        log.warning("this torch has no float8_e4m3fn on %s; the host tier stores int8 instead of fp8", device)
        name = Int8Codec.name
    return CODECS[name](geometry)
