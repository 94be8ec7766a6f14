"""Weight quantization of the exported graphs.

- decoder ``int8``: ``quantize_dynamic``, MatMul weights int8 per output channel, activations
  quantized per step;
- decoder ``int4``: onnxruntime's ``MatMulNBitsQuantizer``, MatMul weights in 4-bit blocks
  along the input dimension, either as the ``com.microsoft.MatMulNBits`` operator
  (``matmulnbits``) or as a block-quantized ``DequantizeLinear`` before a plain ``MatMul``
  at opset 21 (``qdq``), the form TensorRT 10's weight-only INT4 path reads;
- vision ``int8``: ``quantize_dynamic`` of the vision graph's MatMul, Gemm and Conv weights.

Token embeddings are not in the decoder graph (the engine looks them up on the host, in the
checkpoint's own float table), so no variant quantizes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from edgeinfer.backends.onnx.export import WEIGHT_SLICE, graph_files
from edgeinfer.backends.onnx.graphs import DECODER_OUTPUTS
from edgeinfer.errors import BackendUnavailableError, EngineBuildError
from edgeinfer.models.export import AttentionShape

Int4Format = Literal["matmulnbits", "qdq"]
HeadPrecision = Literal["int4", "int8", "fp32"]
INT4_FORMATS: tuple[Int4Format, ...] = get_args(Int4Format)
HEAD_PRECISIONS: tuple[HeadPrecision, ...] = get_args(HeadPrecision)
INT4_BLOCK_SIZES = (32, 64, 128)
# MatMulNBits' accuracy_level: the lowest type its activations may be computed in; 0 leaves it to
# the kernel (float32 on a CPU), 4 quantizes the activations to int8 per block.
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
# The graph's opset once its weights are int4 tensors (DequantizeLinear's block_size and int4 need 21).
QDQ_INT4_OPSET = 21
# Weight name suffixes the quantizer gives the packed weights of a MatMul (MatMulNBits, then Q/DQ).
_PACKED_SUFFIX = re.compile(r"(_DQ)?_Q(2|4|8)$")
# quantize_dynamic's names for a MatMul weight's int8 values and their scale (a Mul after MatMulInteger applies it).
_INT8_SUFFIX, _INT8_SCALE = re.compile(r"_quantized$"), "_scale"


# --------------------------------------------------------------------------- int8


def quantize_decoder(source: Path, target: Path, keep_head_fp32: bool = False) -> dict[str, Any]:
    """Dynamic int8 quantization of the decoder's MatMul weights, per output channel;
    activations stay float and are quantized per step. The vocabulary projection is
    quantized too unless ``keep_head_fp32``: at SmolVLM-256M's shapes it is a fifth of the
    weights, and a decode step on a CPU is bound by the bytes of weights it reads."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source), load_external_data=False)
    excluded = head_nodes(model) if keep_head_fp32 else []
    with _quiet_quantizer():
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"], nodes_to_exclude=excluded,
                         use_external_data_format=_has_external_data(source))
    return {"method": "onnxruntime.quantization.quantize_dynamic", "weights": "int8 per channel",
            "activations": "dynamic (per step)", "ops": ["MatMul"], "excluded": excluded,
            "vocab_projection": "fp32" if keep_head_fp32 else "int8"}


def head_nodes(model) -> list[str]:
    """Names of the MatMul nodes that write the logits (the vocabulary projection)."""
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and DECODER_OUTPUTS[0] in n.output]


# --------------------------------------------------------------------------- int4


@dataclass(frozen=True, slots=True)
class Int4Options:
    """How the decoder's weights are cut into 4-bit blocks.

    ``block_size`` weights along the input dimension share a scale (and, unless
    ``symmetric``, a 4-bit zero point). ``accuracy_level`` is MatMulNBits' attribute: 0
    computes in float32, 4 quantizes each block of activations to int8 and multiplies in
    integers (on a CPU with int8 dot-product instructions, the faster). ``format``
    ``matmulnbits`` writes ONNX Runtime's ``MatMulNBits``; ``qdq`` writes a block-quantized
    ``DequantizeLinear`` (int4 weights, opset 21) before each ``MatMul``, which ONNX Runtime
    fuses back into MatMulNBits on a CPU and TensorRT 10 reads as weight-only INT4. ``head``:
    the vocabulary projection in 4 bits like the rest, in 8-bit blocks, or kept float32.
    """

    # Blocks of 128, symmetric: on both 2-core CPUs measured (AMD EPYC with AVX2; Intel Xeon with
    # AVX-512 VNNI and AMX) faster than blocks of 32 with zero points, and the demo model keeps its
    # accuracy (docs/onnxruntime.md, "int4 for CPUs").
    block_size: int = 128
    symmetric: bool = True
    accuracy_level: int = 4
    format: Int4Format = "matmulnbits"
    head: HeadPrecision = "int4"

    def __post_init__(self) -> None:
        _require_choice("int4 block size", self.block_size, INT4_BLOCK_SIZES)
        _require_choice("int4 accuracy level", self.accuracy_level, ACCURACY_LEVELS)
        _require_choice("int4 format", self.format, INT4_FORMATS)
        _require_choice("int4 head precision", self.head, HEAD_PRECISIONS)
        if not isinstance(self.symmetric, bool):
            raise EngineBuildError(f"int4 symmetric must be true or false, got {self.symmetric!r}")
        if self.format == "qdq" and self.accuracy_level != 4:
            raise EngineBuildError(f"a qdq int4 graph carries no accuracy level (ONNX Runtime fuses it into MatMulNBits "
                                   f"at its session default, 4); got {self.accuracy_level}",
                                   fix="--int4-accuracy-level 4 (or --int4-format matmulnbits)")
        if self.format == "qdq" and not self.symmetric:
            raise EngineBuildError("the qdq int4 format is symmetric: TensorRT's DequantizeLinear takes zero points "
                                   "that are all zero", fix="--int4-symmetric")
        if self.format == "qdq" and self.head == "int8":
            raise EngineBuildError("the qdq int4 format writes 4-bit DequantizeLinear weights only; its head can be "
                                   "int4 or fp32, not int8", fix="--int4-head int4 (or --int4-format matmulnbits)")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Int4Options":
        """The options a manifest recorded; a field it lacks keeps its default."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _require_choice(what: str, value, valid: tuple) -> None:
    if value not in valid or isinstance(value, bool) != isinstance(valid[0], bool):
        raise EngineBuildError(f"{what} {value!r} is not supported; choose one of: {', '.join(map(str, valid))}")


def quantize_decoder_int4(source: Path, target: Path, options: Int4Options) -> dict[str, Any]:
    """The decoder with its MatMul weights in 4-bit blocks (see :class:`Int4Options`); the
    vocabulary projection as ``options.head`` says. Returns what the manifest records."""
    import onnx
    from onnxruntime.quantization import QuantFormat

    model = onnx.load(str(source))
    head = head_nodes(model)
    quant_format = QuantFormat.QDQ if options.format == "qdq" else QuantFormat.QOperator
    common = {"block_size": options.block_size, "is_symmetric": options.symmetric,
              "accuracy_level": options.accuracy_level or None, "quant_format": quant_format,
              "op_types_to_quantize": ("MatMul",)}
    originals = _matmul_weights(model) if options.format == "qdq" else {}
    with _quiet_quantizer():
        model = _matmul_nbits(model, bits=4, nodes_to_exclude=head if options.head != "int4" else [], **common)
        if options.head == "int8":
            model = _matmul_nbits(model, bits=8, nodes_to_exclude=[], **common)
    if options.format == "qdq":
        _requantize_positive(model, originals, options.block_size)
    from edgeinfer.backends.onnx.export import save_graph

    save_graph(model, target)
    counts = _quantized_ops(model)
    return {"method": "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer",
            "weights": f"int4 blocks of {options.block_size} along the input dimension, "
                       f"{'symmetric' if options.symmetric else 'asymmetric (4-bit zero points)'}",
            "scales": "float32, one per block and output column" + (", positive (absmax / 7)" if options.format == "qdq"
                                                                      else ""),
            "activations": _activations(options),
            "options": options.to_json(), "ops": counts,
            "opset": max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
            "vocab_projection": options.head, "embedding": "not in the graph (host lookup, checkpoint dtype)"}


def _matmul_weights(model) -> dict[str, np.ndarray]:
    """The float weights [K, N] of the graph's MatMuls, by initializer name."""
    from onnx import numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    return {n.input[1]: numpy_helper.to_array(weights[n.input[1]]) for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in weights}


def _requantize_positive(model, originals: dict[str, np.ndarray], block_size: int) -> None:
    """Give every int4 DequantizeLinear positive scales, re-quantizing its block from the float
    weights: ``scale = absmax / 7``, ``q = clamp(round(w / scale), -8, 7)``.

    onnxruntime's symmetric quantizer takes ``scale = m / -8`` where ``m`` is the block's weight
    of largest magnitude, so about half its scales are negative; TensorRT's DequantizeLayer
    takes strictly positive scales only (and zero points that are all zero, hence no zero
    points here). Where a block is all zeros its scale is 1 (every q is 0).
    """
    from onnx import TensorProto, helper, numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in weights \
                or weights[node.input[0]].data_type != TensorProto.INT4:
            continue
        w = originals[_PACKED_SUFFIX.sub("", node.input[0])].astype(np.float32)
        rows, cols = w.shape
        blocks = -(-rows // block_size)
        padded = np.zeros((blocks * block_size, cols), np.float32)
        padded[:rows] = w
        amax = np.abs(padded.reshape(blocks, block_size, cols)).max(axis=1)
        scale = np.where(amax > 0, amax / 7, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / np.repeat(scale, block_size, axis=0)[:rows]), -8, 7).astype(np.int8).ravel()
        q = np.append(q, np.int8(0)) if q.size % 2 else q
        packed = ((q[1::2].astype(np.uint8) & 0xF) << 4) | (q[0::2].astype(np.uint8) & 0xF)
        weights[node.input[0]].CopyFrom(helper.make_tensor(node.input[0], TensorProto.INT4, [rows, cols],
                                                           packed.tobytes(), raw=True))
        weights[node.input[1]].CopyFrom(numpy_helper.from_array(scale, node.input[1]))


def _activations(options: Int4Options) -> str:
    if options.format == "qdq":
        return "as the runtime computes DequantizeLinear + MatMul (ONNX Runtime on a CPU: fused MatMulNBits, level 4)"
    return f"{'int8 per block' if options.accuracy_level == 4 else 'float32'} (accuracy_level {options.accuracy_level})"


def _matmul_nbits(model, *, bits: int, **kwargs):
    """One pass of onnxruntime's quantizer over every MatMul with a constant weight not yet
    quantized (quantized ones are no longer MatMul nodes, or read a DequantizeLinear)."""
    quantizer = _nbits_quantizer()(model, bits=bits, **kwargs)
    quantizer.process()
    return quantizer.model.model


def _nbits_quantizer():
    """onnxruntime's MatMulNBitsQuantizer class (its module also needs the ``onnx-ir`` package)."""
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:
        raise BackendUnavailableError(f"the int4 build needs onnxruntime's MatMulNBitsQuantizer, which does not "
                                      f"import here ({exc}); pip install onnx-ir") from exc
    return MatMulNBitsQuantizer


def _quantized_ops(model) -> dict[str, int]:
    kinds = ("MatMulNBits", "DequantizeLinear", "MatMul")
    return {kind: sum(n.op_type == kind for n in model.graph.node) for kind in kinds}


def dequantized_weights(path: Path) -> dict[str, np.ndarray]:
    """The float32 weights ``[K, N]`` a quantized decoder graph multiplies by, under the names
    of the torch parameters they are (``decoder.layers.0.qkv_t``): every MatMulNBits, every
    block-quantized DequantizeLinear and every MatMulInteger weight (the int8 build's, one scale
    per output column), dequantized as ONNX Runtime does, ``(q - zero) * scale``.
    Weights that are column slices of one parameter (``decoder.layers.0.qkv_t[:,0:64]`` and
    ``[:,64:96]``, see :func:`~edgeinfer.backends.onnx.export.name_weight_slices`) are joined
    back into that parameter."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    weights = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            arrays = [numpy_helper.to_array(weights[n]) if n else None for n in node.input[1:4]]
            out[_PACKED_SUFFIX.sub("", node.input[1])] = _dequantize_nbits(*(arrays + [None] * (3 - len(arrays))),
                                                                           **attrs)
        elif node.op_type == "DequantizeLinear" and node.input[0] in weights:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            arrays = [numpy_helper.to_array(weights[n]) if n else None for n in node.input]
            out[_PACKED_SUFFIX.sub("", node.input[0])] = _dequantize_blocked(*(arrays + [None] * (3 - len(arrays))),
                                                                             **attrs)
        elif node.op_type == "MatMulInteger" and node.input[1] in weights:
            name = _INT8_SUFFIX.sub("", node.input[1])
            zero = weights.get(node.input[3]) if len(node.input) > 3 else None
            q = numpy_helper.to_array(weights[node.input[1]]).astype(np.float32)
            scale = numpy_helper.to_array(weights[name + _INT8_SCALE]).astype(np.float32)
            out[name] = (q - (0.0 if zero is None else numpy_helper.to_array(zero).astype(np.float32))) * scale
    return _joined_slices(out)


def _joined_slices(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``weights`` with the column slices of each parameter joined into it, in column order;
    slices that leave a gap or overlap are an error naming the columns they cover."""
    out: dict[str, np.ndarray] = {}
    slices: dict[str, list[tuple[int, int, np.ndarray]]] = {}
    for name, weight in weights.items():
        match = WEIGHT_SLICE.match(name)
        if match is None:
            out[name] = weight
        else:
            slices.setdefault(match["parameter"], []).append((int(match["start"]), int(match["stop"]), weight))
    for parameter, parts in slices.items():
        parts.sort(key=lambda part: part[0])
        if [start for start, _, _ in parts] != [0] + [stop for _, stop, _ in parts[:-1]]:
            covered = ", ".join(f"{start}:{stop}" for start, stop, _ in parts)
            raise EngineBuildError(f"the graph's weights cover columns {covered} of {parameter}, "
                                   f"not 0:{parts[-1][1]} without a gap")
        out[parameter] = np.concatenate([weight for _, _, weight in parts], axis=1)
    return out


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Unsigned ``bits``-bit values packed low bits first in bytes, last axis -> ``count`` values."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    values = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)[..., :count]


def _dequantize_nbits(packed, scales, zeros, *, K: int, N: int, bits: int, block_size: int,
                      **_: Any) -> np.ndarray:
    blocks = -(-K // block_size)
    q = _unpack(packed.reshape(N, -1), bits, blocks * block_size).astype(np.float32)
    scale = scales.reshape(N, blocks).astype(np.float32)
    if zeros is None:
        zero = np.full((N, blocks), 1 << (bits - 1), dtype=np.float32)
    else:
        zero = _unpack(zeros.reshape(N, -1), bits, blocks).astype(np.float32)
    w = (q.reshape(N, blocks, block_size) - zero[..., None]) * scale[..., None]
    return np.ascontiguousarray(w.reshape(N, -1)[:, :K].T)


def _dequantize_blocked(q, scales, zeros, *, axis: int = 0, block_size: int = 0, **_: Any) -> np.ndarray:
    if axis != 0 or not block_size:
        raise EngineBuildError(f"a DequantizeLinear of weights blocked along axis {axis} (block {block_size}) "
                               "is not one edgeinfer writes")
    rows = q.shape[0]
    scale = np.repeat(scales.astype(np.float32), block_size, axis=0)[:rows]
    zero = 0.0 if zeros is None else np.repeat(zeros.astype(np.float32), block_size, axis=0)[:rows]
    return np.ascontiguousarray((q.astype(np.float32) - zero) * scale)


# --------------------------------------------------------------------------- vision int8

VISION_INT8_OPS = ("MatMul", "Gemm", "Conv")


def quantize_vision(source: Path, target: Path, attention: AttentionShape | None = None) -> dict[str, Any]:
    """Dynamic int8 quantization of the vision graph's weights (MatMul, Gemm and the patch
    Conv), per output channel; products of two activations (attention) stay float.

    With ``attention`` the graph is first fused by ONNX Runtime's transformer optimizer
    (attention, GELU, residual + LayerNorm), and the fused attention is quantized as well
    (``QAttention``: its q|k|v product int8, its scores float). A fusion that the optimizer fails
    on, that finds no attention, or that drops an input other than the key-padding mask (which it
    drops, and which is wired back into every attention) is not used."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fused_path = target.parent / f"{target.stem}.fused.onnx"
    fused = _fuse_vision(source, fused_path, attention) if attention else None
    ops = [*VISION_INT8_OPS, "Attention"] if fused else list(VISION_INT8_OPS)
    try:
        with _quiet_quantizer():
            # The fused operators are outside ONNX's type inference: their outputs are float.
            quantize_dynamic(str(fused_path if fused else source), str(target), weight_type=QuantType.QInt8,
                             per_channel=True, op_types_to_quantize=ops,
                             use_external_data_format=_has_external_data(source),
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        if fused:
            for name in graph_files(target.parent, fused_path.name):
                (target.parent / name).unlink()
    out = {"method": "onnxruntime.quantization.quantize_dynamic", "weights": "int8 per channel",
           "activations": "dynamic (per call)", "ops": ops}
    if fused:
        out["fused"] = fused
    return out


def _fuse_vision(source: Path, target: Path, attention: AttentionShape) -> dict[str, int] | None:
    """Write the vision graph through ONNX Runtime's transformer optimizer (ViT fusions) to
    ``target``, the key-padding mask given to every fused attention as its ``mask_index``; the
    fused operators' counts, or None (nothing written) when the fusion is not used."""
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        with _quiet_quantizer():
            model = optimize_model(str(source), model_type="vit", num_heads=attention.heads,
                                   hidden_size=attention.hidden, optimization_options=FusionOptions("vit"),
                                   opt_level=0, use_gpu=False)
    except Exception:  # the optimizer's pattern matching raises many types; the unfused graph is still right
        return None
    counts = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    graph = model.model.graph
    inputs = {i.name: i for i in onnx.load(str(source), load_external_data=False).graph.input}
    dropped = set(inputs) - {i.name for i in graph.input}
    mask = attention.key_padding_mask
    if not counts.get("Attention") or dropped - {mask}:
        return None
    if mask:
        if mask in dropped:
            graph.input.append(inputs[mask])
        # Attention's mask_index (input 3), [rows, positions] int32, 1 where kept; quantize_dynamic
        # carries it into QAttention.
        cast = f"{mask}_int32"
        graph.node.insert(0, onnx.helper.make_node("Cast", [mask], [cast], to=onnx.TensorProto.INT32,
                                                   name=f"{mask}_cast"))
        for node in graph.node:
            if node.op_type == "Attention":
                node.input.extend([""] * max(0, 4 - len(node.input)))
                node.input[3] = cast
    model.save_model_to_file(str(target), use_external_data_format=_has_external_data(source))
    return counts


# --------------------------------------------------------------------------- shared


def _has_external_data(path: Path) -> bool:
    return (path.parent / (path.name + ".data")).is_file()


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """onnxruntime's quantizers log every node at INFO and advise a pre-processing pass, and
    importing ``matmul_nbits_quantizer`` calls ``logging.basicConfig`` at INFO: the root
    logger is put back as it was and their records are dropped while they run."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
        root.handlers[:] = handlers
        root.setLevel(level)
