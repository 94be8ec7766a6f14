"""One quantized linear weight as its checkpoint stores it, and how each layout unpacks.

A :class:`QuantizedWeight` keeps the packed tensors as they were read (GPU kernels consume
that form); :meth:`QuantizedWeight.dequantize` gives the dense ``[out, in]`` weight the torch
CPU backend runs. Every layout dequantizes by the same rule,
``w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]`` with ``g(i)`` the input column's group,
computed in the scales' dtype as the formats' own reference code does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from edgeinfer.errors import ModelLoadError

# AWQ's GEMM kernel reads the eight 4-bit values of an int32 in this order: nibble ``i``
# (bits 4i..4i+3) holds output column ``AWQ_PACK_ORDER[i]`` of its block of eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class PackedLayout(str, Enum):
    COMPRESSED_TENSORS = "compressed-tensors"  # weight_packed [out, in*b/32], values offset by 2^(b-1)
    GPTQ = "gptq"  # qweight [in*b/32, out]: packed along input rows
    AWQ = "awq"  # qweight [in, out*b/32]: packed along output columns, AWQ_PACK_ORDER


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A linear layer's low-bit weight, kept packed as stored.

    ``packed``, ``scales``, ``zeros`` and ``g_idx`` are the checkpoint's own tensors in
    ``layout``; ``shape`` is the dense ``[out, in]`` weight; ``group_size`` the input columns
    per scale (``in`` for one scale per output row).
    """

    name: str
    layout: PackedLayout
    bits: int
    group_size: int
    shape: tuple[int, int]
    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None = None
    zeros_minus_one: bool = False  # classic GPTQ: each stored zero is one less than the true zero

    @property
    def nbytes(self) -> int:
        """Bytes the quantized form takes (packed values, scales, zero points, group index)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros, self.g_idx)
                   if t is not None)

    def codes(self) -> torch.Tensor:
        """The quantized values, [out, in] int32."""
        if self.layout is PackedLayout.COMPRESSED_TENSORS:
            return unpack_compressed_tensors(self.packed, self.bits, self.shape).to(torch.int32)
        if self.layout is PackedLayout.GPTQ:
            return unpack_rows(self.packed, self.bits, self.shape[0]).t()
        return unpack_awq_columns(self.packed, self.bits).t()

    def zero_points(self) -> torch.Tensor:
        """[out, groups] zero points, in the same domain as :meth:`codes`."""
        out = self.shape[0]
        groups = self.scales_by_row().shape[1]
        if self.layout is PackedLayout.COMPRESSED_TENSORS:
            if self.zeros is None:  # symmetric: the signed values are centred on zero
                return torch.zeros(out, groups, dtype=torch.int32)
            return unpack_compressed_tensors(self.zeros, self.bits, (out, groups), packed_dim=0).to(torch.int32)
        if self.layout is PackedLayout.GPTQ:
            zeros = unpack_columns(self.zeros, self.bits)[:, :out]
            return (zeros + 1 if self.zeros_minus_one else zeros).t()
        return unpack_awq_columns(self.zeros, self.bits)[:, :out].t()

    def scales_by_row(self) -> torch.Tensor:
        """[out, groups] scales."""
        return self.scales if self.layout is PackedLayout.COMPRESSED_TENSORS else self.scales.t()

    def group_index(self) -> torch.Tensor:
        """[in] the group of each input column: ``g_idx`` when stored (act-order), else ``i // group_size``."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.shape[1]) // self.group_size

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense [out, in] weight in ``dtype``."""
        scales = self.scales_by_row()
        group = self.group_index()
        values = self.codes().to(scales.dtype) - self.zero_points()[:, group].to(scales.dtype)
        return (values * scales[:, group]).to(dtype)


def unpack_compressed_tensors(packed: torch.Tensor, bits: int, shape: tuple[int, int],
                              packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' dense int32 packing -> signed int8 values of ``shape``, through
    compressed-tensors' own ``unpack_from_int32`` (so the bit layout is the library's)."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError as exc:
        raise ModelLoadError("compressed-tensors checkpoints need the compressed-tensors package: "
                             "pip install 'edgeinfer[quant]'") from exc
    return unpack_from_int32(packed, bits, torch.Size(shape), packed_dim=packed_dim)


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """GPTQ ``qweight`` [rows*b/32, cols] -> [rows, cols]: value ``j`` of word ``r`` (bits
    ``b*j``..) is row ``r*32/b + j``."""
    values = (packed.unsqueeze(1) >> _shifts(bits).view(1, -1, 1)) & ((1 << bits) - 1)  # [R, 32/b, cols]
    return values.reshape(-1, cols)


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols*b/32] -> [rows, cols]: value ``j`` of word ``c`` is column ``c*32/b + j``
    (GPTQ's ``qzeros``)."""
    values = (packed.unsqueeze(-1) >> _shifts(bits)) & ((1 << bits) - 1)  # [rows, C, 32/b]
    return values.reshape(packed.shape[0], -1)


def unpack_awq_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """AWQ GEMM ``qweight`` / ``qzeros`` [rows, cols*b/32] -> [rows, cols], undoing the
    interleave: nibble ``i`` of each word is column ``AWQ_PACK_ORDER[i]`` of its block."""
    in_word_order = unpack_columns(packed, bits).view(packed.shape[0], -1, 32 // bits)
    columns = torch.empty_like(in_word_order)
    columns[..., list(AWQ_PACK_ORDER)] = in_word_order
    return columns.view(packed.shape[0], -1)
