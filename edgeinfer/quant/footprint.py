"""What a checkpoint's weights take: their format and bytes, read from the safetensors headers
alone (no tensor is loaded), for ``edgeinfer doctor --model``."""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import ModelLoadError
from edgeinfer.quant.formats import read_quant_scheme

# The tensor names that mark a quantized layer (compressed-tensors, then GPTQ / AWQ).
PACKED_MARKERS = (".weight_packed", ".qweight")


@dataclass(frozen=True, slots=True)
class WeightFootprint:
    format: str  # the quantization scheme's label, or "dense <dtype>"
    total_bytes: int  # every tensor of the checkpoint
    quantized_layers: int
    quantized_bytes: int  # the packed values, scales and zero points of those layers

    def describe(self) -> str:
        line = f"{self.format}, {self.total_bytes / 2**20:.1f} MiB of weights"
        if self.quantized_layers:
            line += f" ({self.quantized_layers} quantized layers: {self.quantized_bytes / 2**20:.1f} MiB)"
        return line


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
    return WeightFootprint(label, sum(sizes.values()), len(layers), quantized)
