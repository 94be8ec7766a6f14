"""What a checkpoint's weights take: their format and bytes, read from the safetensors headers
alone (no tensor is loaded), for ``edgeinfer doctor --model``; and the bytes one decode step
reads from them, for the benchmarks' byte roofline."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import ModelLoadError
from edgeinfer.quant.formats import read_quant_scheme

# The tensor names that mark a quantized layer (compressed-tensors, then GPTQ / AWQ).
PACKED_MARKERS = (".weight_packed", ".qweight")
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
# Stored beside a packed layer and never read by a decode step: its dense shape, as metadata.
METADATA_SUFFIXES = (".weight_shape",)
# The decoder's tensors under the family adapters' canonical names (``text.*``).
TEXT_PREFIX = "text."
EMBEDDING = "text.embed_tokens.weight"
HEAD_PREFIX = "text.lm_head."
UNREAD = ("text.rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class WeightFootprint:
    format: str  # the quantization scheme's label, or "dense <dtype>"
    total_bytes: int  # every tensor of the checkpoint
    quantized_layers: int
    quantized_bytes: int  # the packed values, scales and zero points of those layers
    quantized_values: int = 0  # the weights those layers hold, as a dense model would
    head_values: int = 0  # of those weights, a quantized lm_head's (0 where it is dense)

    def describe(self) -> str:
        line = f"{self.format}, {self.total_bytes / 2**20:.1f} MiB of weights"
        if self.quantized_layers:
            line += f" ({self.quantized_layers} quantized layers: {self.quantized_bytes / 2**20:.1f} MiB)"
        return line

    def saved_bytes(self, dtype_bytes: int) -> int:
        """What the quantized layers, kept packed, save against the dense model at ``dtype_bytes`` a
        value (at most: a product the GPU kernels cannot read packed is held dense). A quantized
        lm_head saves nothing and costs its bytes, as :func:`edgeinfer.quant.packed.bytes_saved`
        counts it."""
        return max(0, (self.quantized_values - self.head_values) * dtype_bytes - self.quantized_bytes)


def _header(file: Path) -> dict:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc
    header.pop("__metadata__", None)
    return header


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir / 'model.safetensors'} is missing (no safetensors weights)")
    return files


def weight_footprint(model_dir: str | Path) -> WeightFootprint:
    """The weight format and bytes of the checkpoint in ``model_dir``; an unsupported
    quantization config is refused as a load would refuse it."""
    model_dir = Path(model_dir)
    scheme = read_quant_scheme(model_dir)
    entries = {name: meta for file in _weight_files(model_dir) for name, meta in _header(file).items()}
    sizes = {name: meta["data_offsets"][1] - meta["data_offsets"][0] for name, meta in entries.items()}
    layers = {name.rsplit(".", 1)[0] for name in entries if name.endswith(PACKED_MARKERS)}
    quantized = sum(size for name, size in sizes.items() if name.rsplit(".", 1)[0] in layers)
    if scheme is not None:
        label = scheme.label
    else:
        dtypes = Counter()
        for name, meta in entries.items():
            dtypes[meta["dtype"]] += sizes[name]
        label = f"dense {dtypes.most_common(1)[0][0] if dtypes else 'empty'}"
    values = {name: _dense_values(name, meta["shape"], scheme) for name, meta in entries.items()
              if name.endswith(PACKED_MARKERS)}
    # the output projection, as checkpoints name it: ``lm_head`` or ``language_model.lm_head``
    head_values = sum(n for name, n in values.items() if name.rsplit(".", 2)[-2] == "lm_head")
    return WeightFootprint(label, sum(sizes.values()), len(layers), quantized, sum(values.values()), head_values)


def _dense_values(name: str, shape: list[int], scheme) -> int:
    """The weights a packed tensor (``weight_packed`` / ``qweight``) holds: 32/b values to a word,
    packed along the input (compressed-tensors, GPTQ) or the output (AWQ)."""
    layer = name.rsplit(".", 1)[0]
    weight_scheme = scheme.scheme_for(layer) if scheme is not None else None
    bits = weight_scheme.bits if weight_scheme is not None else 4
    return math.prod(shape) * (32 // bits)


@dataclass(frozen=True, slots=True)
class DecodeWeightBytes:
    """The bytes of a checkpoint's decoder that one decode step reads, as stored: every
    quantized layer's packed values, scales and zero points (``quantized``), the dense
    tensors of the decoder layers and the final norm (``dense``: dense linears, norms,
    biases), the output projection (``head``: ``lm_head`` as stored, or the whole embedding
    matrix when the head is tied to it) and one row of the embedding (``embedding_row``).
    The vision tower and the projector run once per picture, not per token: not counted."""

    quantized: int
    dense: int
    head: int
    embedding_row: int
    quantized_layers: int
    tied_head: bool

    @property
    def per_step(self) -> int:
        return self.quantized + self.dense + self.head + self.embedding_row

    def to_dict(self) -> dict:
        return {"quantized": self.quantized, "dense": self.dense, "head": self.head,
                "embedding_row": self.embedding_row, "quantized_layers": self.quantized_layers,
                "tied_head": self.tied_head, "per_step": self.per_step}


def _text_names(model_dir: Path, names: list[str]) -> dict[str, str]:
    """Checkpoint name -> canonical name, for the decoder's tensors only (its family adapter's
    weight map decides which tensors are the decoder's)."""
    from edgeinfer.errors import UnsupportedArchitectureError
    from edgeinfer.models.base import rename_weights
    from edgeinfer.models.registry import (
        adapter_for,
        not_yet_supported,
        supported_architectures,
    )

    config_file = model_dir / "config.json"
    try:
        architectures = list(json.loads(config_file.read_text()).get("architectures") or [])
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} cannot be read: {exc}") from exc
    adapter = adapter_for(architectures)
    if adapter is None:
        raise UnsupportedArchitectureError(architectures, supported_architectures(), not_yet_supported(architectures))
    try:
        mapping = rename_weights(names, adapter.weight_renames)
    except KeyError as exc:
        raise ModelLoadError(f"{model_dir}: {exc.args[0]}") from None
    return {name: new for name, new in mapping.items() if new.startswith(TEXT_PREFIX)}


def decode_weight_bytes(model_dir: str | Path, run_dtype_bytes: int | None = None) -> DecodeWeightBytes:
    """The decoder bytes one decode step of the checkpoint in ``model_dir`` reads (read from the
    safetensors headers; no tensor is loaded). Quantized layers count as stored (the engine keeps
    them so); dense floating-point tensors count at ``run_dtype_bytes`` per value when given, since
    a load in another dtype than the checkpoint's converts them (an fp32 file run in bf16 reads half)."""
    model_dir = Path(model_dir)
    read_quant_scheme(model_dir)  # a format a load would refuse is refused here too
    entries = {name: meta for file in _weight_files(model_dir) for name, meta in _header(file).items()}
    text = _text_names(model_dir, list(entries))
    packed_layers = {name.rsplit(".", 1)[0] for name in entries if name.endswith(PACKED_MARKERS)}

    def size(name: str, meta: dict) -> int:
        stored = meta["data_offsets"][1] - meta["data_offsets"][0]
        if run_dtype_bytes is None or meta["dtype"] not in FLOAT_DTYPES or name.rsplit(".", 1)[0] in packed_layers:
            return stored
        return math.prod(meta["shape"]) * run_dtype_bytes

    sizes = {text[name]: size(name, meta) for name, meta in entries.items()
             if name in text and not name.endswith(METADATA_SUFFIXES) and text[name] not in UNREAD}
    if EMBEDDING not in sizes:
        raise ModelLoadError(f"{model_dir}: the decoder has no {EMBEDDING.removeprefix(TEXT_PREFIX)}")
    rows = next(meta["shape"][0] for name, meta in entries.items() if text.get(name) == EMBEDDING)
    embedding = sizes.pop(EMBEDDING)
    head = {name: size for name, size in sizes.items() if name.startswith(HEAD_PREFIX)}
    body = {name: size for name, size in sizes.items() if name not in head}
    layers = {name.rsplit(".", 1)[0] for name in body if name.endswith(PACKED_MARKERS)}
    quantized = sum(size for name, size in body.items() if name.rsplit(".", 1)[0] in layers)
    tied = not head
    return DecodeWeightBytes(quantized=quantized, dense=sum(body.values()) - quantized,
                             head=embedding if tied else sum(head.values()), embedding_row=embedding // rows,
                             quantized_layers=len(layers), tied_head=tied)
