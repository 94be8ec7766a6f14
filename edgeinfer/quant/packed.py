"""A decoder product's weight kept low-bit on the device: :class:`PackedMatrix`.

On a GPU the decoder's products (q|k|v, o, gate|up, down, and a quantized ``lm_head``) keep the
checkpoint's low-bit values instead of a dense copy, so a decode step reads a quarter (4-bit)
or half (8-bit) of the bytes, and the memory they no longer take goes to the KV pool. The
checkpoint's layouts (compressed-tensors, GPTQ, AWQ) are brought to one form at load, which the
kernels of :mod:`edgeinfer.quant.kernels` read: unsigned codes packed along the input, per-group
scales and (asymmetric schemes only) zero points. Products whose parts cannot take that form
(act-order ``g_idx``, group sizes that are not powers of two, mixed schemes) stay dense, and
:func:`pack_product` says why.
"""

from __future__ import annotations

import torch
from torch import library as op_registry
from torch import nn

from edgeinfer.quant import kernels
from edgeinfer.quant.kernels import dequantize_with_torch
from edgeinfer.quant.launching import PackedGeometry, pow2
from edgeinfer.quant.weights import PackedLayout as StoredLayout
from edgeinfer.quant.weights import QuantizedWeight

BITS = (4, 8)


class PackedMatrix(nn.Module):
    """An ``[out, in]`` weight as ``codes`` int32 ``[out, in·b/32]``, ``scales`` ``[out, groups]`` and
    ``zeros`` ``[out, groups]`` (None: the symmetric centre ``2^(b-1)``); ``matmul`` is ``x @ W.T``."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                 group_size: int, shape: tuple[int, int]) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.bits = bits
        self.group_size = group_size  # input columns per scale (``in`` for one per row)
        self.shape = shape

    @property
    def layout(self) -> PackedGeometry:
        n, k = self.shape
        one_group = self.group_size >= k
        return PackedGeometry(n, k, self.bits, self.scales.shape[1], pow2(k) if one_group else self.group_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` [..., in], in ``x``'s dtype."""
        layout = self.layout
        return packed_linear(x, self.codes, self.scales, self.zeros, layout.bits, layout.group_constexpr,
                             layout.groups)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[out, in]`` weight in ``dtype``."""
        return _dequantize(self.codes, self.scales, self.zeros, self.layout, dtype)

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, bits={self.bits}, group_size={self.group_size}"


def _dequantize(codes, scales, zeros, layout: PackedGeometry, dtype: torch.dtype) -> torch.Tensor:
    if kernels.usable(codes.device):
        return kernels.dequantize(codes, scales, zeros, layout, dtype)
    return dequantize_with_torch(codes, scales, zeros, layout, dtype)


# The product is an op of its own library, so torch.compile and CUDA graphs take it as one
# opaque call; its fake implementation gives compiled graphs the output's shape.
OP_LIBRARY, OP_NAME = "edgeinfer", "packed_linear"
_LIBRARY = op_registry.Library(OP_LIBRARY, "FRAGMENT")
_LIBRARY.define(f"{OP_NAME}(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits, int group_size, "
                "int groups) -> Tensor")


def _packed_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   bits: int, group_size: int, groups: int) -> torch.Tensor:
    """``x @ W.T`` with W packed (see :class:`PackedMatrix`): the low-bit kernel for a few rows,
    dequantize + GEMM for a prompt's many."""
    k = x.shape[-1]
    layout = PackedGeometry(codes.shape[0], k, bits, groups, group_size)
    rows = x.reshape(-1, k)
    if rows.shape[0] <= kernels.MAX_DOT_ROWS and kernels.usable(x.device):
        y = kernels.packed_mm(rows, codes, scales, zeros, layout)
    else:
        y = rows @ _dequantize(codes, scales, zeros, layout, x.dtype).t()
    return y.reshape(*x.shape[:-1], layout.n)


_LIBRARY.impl(OP_NAME, _packed_linear, "CompositeExplicitAutograd")
packed_linear = getattr(getattr(torch.ops, OP_LIBRARY), OP_NAME).default


@op_registry.register_fake(packed_linear)
def _(x, codes, scales, zeros, bits, group_size, groups):
    return x.new_empty(*x.shape[:-1], codes.shape[0])


def why_not_packable(weights: list[QuantizedWeight]) -> str | None:
    """None when ``weights`` (the parts of one product, stacked along the output) can be one
    :class:`PackedMatrix`, else the reason."""
    first = weights[0]
    k = first.shape[1]
    for w in weights:
        if w.bits not in BITS:
            return f"{w.name} is {w.bits}-bit (the kernels read {' and '.join(map(str, BITS))}-bit)"
        if w.g_idx is not None and not torch.equal(w.group_index(), torch.arange(k) // w.group_size):
            return f"{w.name} is act-order (its g_idx reorders the groups)"
        if (w.bits, w.group_size, w.shape[1], w.scales.dtype) != (first.bits, first.group_size, k, first.scales.dtype):
            return f"{w.name} and {first.name} differ in bits, group size, inputs or scale dtype"
    if k % (32 // first.bits):
        return f"{first.name} has {k} inputs, not a multiple of {32 // first.bits}"
    gs = first.group_size
    if gs < k and (gs < 32 or gs & (gs - 1)):
        return f"{first.name} has groups of {gs} (the kernels read groups of 32, 64, 128... or one per row)"
    return None


def _offset(w: QuantizedWeight) -> int:
    """What brings ``w``'s codes to unsigned: compressed-tensors stores them signed."""
    return 1 << (w.bits - 1) if w.layout is StoredLayout.COMPRESSED_TENSORS else 0


def _pack_columns(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] unsigned b-bit values -> [N, K·b/32] int32, consecutive columns from the lowest bits."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (u.to(torch.int64).view(u.shape[0], -1, per) << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of the top bit


def pack_product(weights: list[QuantizedWeight]) -> PackedMatrix:
    """One :class:`PackedMatrix` for the parts of a product (q, k, v or gate, up), stacked along the
    output in the order given. Raises ValueError with :func:`why_not_packable`'s reason."""
    reason = why_not_packable(weights)
    if reason is not None:
        raise ValueError(reason)
    first = weights[0]
    codes = torch.cat([w.codes() + _offset(w) for w in weights])
    scales = torch.cat([w.scales_by_row() for w in weights]).contiguous()
    zeros = torch.cat([w.zero_points() + _offset(w) for w in weights])
    # Symmetric schemes (GPTQ's ``sym`` stores its zero points all the same) read none.
    zeros = None if bool((zeros == 1 << (first.bits - 1)).all()) else zeros.to(scales.dtype).contiguous()
    shape = (codes.shape[0], first.shape[1])
    group_size = first.group_size if first.group_size < first.shape[1] else first.shape[1]
    return PackedMatrix(_pack_columns(codes, first.bits), scales, zeros, first.bits, group_size, shape)


def bytes_saved(module: nn.Module, dtype: torch.dtype) -> int:
    """What the packed products under ``module`` save against the dense model in ``dtype``: each
    packed product's dense bytes less its packed ones. A packed ``lm_head`` (``module.lm_head_t``)
    saves nothing and costs its own bytes: the input embeddings stand beside it, and in the dense
    model it may have been those same embeddings (``edgeinfer quantize --lm-head`` unties them for
    it), taking no memory of its own."""
    head = getattr(module, "lm_head_t", None)
    return sum(-m.nbytes if m is head else m.shape[0] * m.shape[1] * dtype.itemsize - m.nbytes
               for m in module.modules() if isinstance(m, PackedMatrix))
