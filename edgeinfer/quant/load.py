"""The load transform: a quantized checkpoint's packed tensors become dense linear weights.

The model loader reads every tensor of a checkpoint, then calls :func:`dequantize_tensors`
before it maps names to a family: each quantized layer's stored tensors
(``*.weight_packed / weight_scale / weight_zero_point / weight_shape`` for compressed-tensors,
``*.qweight / qzeros / scales / g_idx`` for GPTQ and AWQ) are replaced by ``*.weight``, so every
family loads without knowing about quantization. Layers the config leaves out keep their
dense ``*.weight``. Where the weights run on a GPU the loader asks to keep the packed form:
each layer's ``*.weight`` is then its :class:`QuantizedWeight`, which the decoder keeps packed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from edgeinfer.errors import ModelLoadError
from edgeinfer.quant.formats import QuantMethod, QuantScheme, WeightScheme
from edgeinfer.quant.weights import PackedLayout, QuantizedWeight

# The tensors one quantized layer stores, per method; the first names the layer.
STORED = {
    QuantMethod.COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                                     "weight_g_idx"),
    QuantMethod.GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
    QuantMethod.AWQ: ("qweight", "qzeros", "scales"),
}


@dataclass(frozen=True, slots=True)
class QuantizedCheckpoint:
    """What a quantized checkpoint held: its scheme, the quantized layers' names, the bytes their
    packed form takes, and (when asked to keep them) each layer's packed weight by name."""

    scheme: QuantScheme
    layers: tuple[str, ...] = ()
    nbytes: int = 0  # the packed layers' bytes as stored (values, scales, zero points, g_idx)
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)


def dequantize_tensors(tensors: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype,
                       keep_packed: bool = False) -> tuple[dict[str, torch.Tensor | QuantizedWeight],
                                                           QuantizedCheckpoint]:
    """``tensors`` with each quantized layer's stored tensors replaced by its ``*.weight``: dense in
    ``dtype``, or with ``keep_packed`` the layer's :class:`QuantizedWeight` itself (the decoder then
    keeps the products its kernels read packed, and dequantizes the rest as it loads them).
    Stored tensors that do not fit each other or the scheme are a :class:`ModelLoadError`
    naming the tensor and the shape expected."""
    names = STORED[scheme.method]
    layers = sorted(n[: -len(names[0]) - 1] for n in tensors if n.endswith("." + names[0]))
    out: dict[str, torch.Tensor | QuantizedWeight] = dict(tensors)
    packed: dict[str, QuantizedWeight] = {}
    for layer in layers:
        weight_scheme = scheme.scheme_for(layer)
        if weight_scheme is None:
            raise ModelLoadError(f"{layer}.{names[0]} is packed, but the quantization config leaves {layer} "
                                 "unquantized (ignore / modules_to_not_convert)")
        stored = {n: out.pop(f"{layer}.{n}") for n in names if f"{layer}.{n}" in out}
        weight = READERS[scheme.method](layer, stored, weight_scheme, scheme)
        out[f"{layer}.weight"] = weight if keep_packed else weight.dequantize(dtype)
        packed[layer] = weight
    nbytes = sum(w.nbytes for w in packed.values())
    return out, QuantizedCheckpoint(scheme, tuple(layers), nbytes, packed if keep_packed else {})


def _expect(layer: str, name: str, stored: dict[str, torch.Tensor], shape: tuple[int, ...],
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """``stored[name]``, checked to have ``shape`` (and ``dtype``)."""
    if name not in stored:
        raise ModelLoadError(f"checkpoint lacks {layer}.{name} (expected shape {list(shape)})")
    tensor = stored[name]
    if tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(f"{layer}.{name} has shape {list(tensor.shape)}, expected {list(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ModelLoadError(f"{layer}.{name} is {tensor.dtype}, expected {dtype}")
    return tensor


def _groups(columns: int, group_size: int | None) -> tuple[int, int]:
    """(group count, columns per group) of a layer with ``columns`` inputs."""
    if group_size is None:
        return 1, columns
    return math.ceil(columns / group_size), group_size


def _compressed_tensors(layer: str, stored: dict[str, torch.Tensor], ws: WeightScheme,
                        scheme: QuantScheme) -> QuantizedWeight:
    shape_tensor = _expect(layer, "weight_shape", stored, (2,))
    out, cols = (int(v) for v in shape_tensor.tolist())
    packed = _expect(layer, "weight_packed", stored, (out, math.ceil(cols * ws.bits / 32)), torch.int32)
    groups, group_size = _groups(cols, ws.group_size)
    scales = _expect(layer, "weight_scale", stored, (out, groups))
    zeros = None
    if not ws.symmetric:
        zeros = _expect(layer, "weight_zero_point", stored, (math.ceil(out * ws.bits / 32), groups), torch.int32)
    # Older compressed-tensors wrote act-order ("actorder": "group") with a column -> group map.
    g_idx = _expect(layer, "weight_g_idx", stored, (cols,)) if ws.desc_act or "weight_g_idx" in stored else None
    return QuantizedWeight(layer, PackedLayout.COMPRESSED_TENSORS, ws.bits, group_size, (out, cols), packed,
                           scales, zeros, g_idx)


def _gptq(layer: str, stored: dict[str, torch.Tensor], ws: WeightScheme, scheme: QuantScheme) -> QuantizedWeight:
    qweight = stored["qweight"]
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ModelLoadError(f"{layer}.qweight is {qweight.dtype} {list(qweight.shape)}, expected a 2-D int32 tensor")
    cols, out = qweight.shape[0] * 32 // ws.bits, qweight.shape[1]
    groups, group_size = _groups(cols, ws.group_size)
    scales = _expect(layer, "scales", stored, (groups, out))
    zeros = _expect(layer, "qzeros", stored, (groups, math.ceil(out * ws.bits / 32)), torch.int32)
    g_idx = stored.get("g_idx")
    if ws.desc_act or g_idx is not None:
        g_idx = _expect(layer, "g_idx", stored, (cols,))
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ModelLoadError(f"{layer}.g_idx names groups {int(g_idx.min())}..{int(g_idx.max())}, "
                                 f"expected 0..{groups - 1}")
    return QuantizedWeight(layer, PackedLayout.GPTQ, ws.bits, group_size, (out, cols), qweight, scales, zeros,
                           g_idx, zeros_minus_one=scheme.gptq_zeros_minus_one)


def _awq(layer: str, stored: dict[str, torch.Tensor], ws: WeightScheme, scheme: QuantScheme) -> QuantizedWeight:
    qweight = stored["qweight"]
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ModelLoadError(f"{layer}.qweight is {qweight.dtype} {list(qweight.shape)}, expected a 2-D int32 tensor")
    cols, out = qweight.shape[0], qweight.shape[1] * 32 // ws.bits
    groups, group_size = _groups(cols, ws.group_size)
    scales = _expect(layer, "scales", stored, (groups, out))
    zeros = _expect(layer, "qzeros", stored, (groups, qweight.shape[1]), torch.int32)
    return QuantizedWeight(layer, PackedLayout.AWQ, ws.bits, group_size, (out, cols), qweight, scales, zeros)


READERS: dict[QuantMethod, Callable[..., QuantizedWeight]] = {
    QuantMethod.COMPRESSED_TENSORS: _compressed_tensors,
    QuantMethod.GPTQ: _gptq,
    QuantMethod.AWQ: _awq,
}
