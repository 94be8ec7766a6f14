"""Load a local Hugging Face checkpoint folder into a family adapter, decoder and vision engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeinfer.errors import ModelLoadError, UnsupportedArchitectureError
from edgeinfer.models.base import Checkpoint, FamilyAdapter, rename_weights
from edgeinfer.models.decoder import Decoder
from edgeinfer.models.registry import adapter_for, not_yet_supported, supported_architectures
from edgeinfer.quant import QuantizedCheckpoint, QuantizedWeight, dequantize_tensors, read_quant_scheme
from edgeinfer.quant import kernels


@dataclass(slots=True)
class LoadedModel:
    adapter: FamilyAdapter
    decoder: Decoder
    vision: torch.nn.Module
    dtype: torch.dtype
    name: str
    # A quantized checkpoint's scheme and layers (its packed weights too, where the load kept them).
    quantized: QuantizedCheckpoint | None = None


def _require(path: Path, name: str, hint: str = "") -> Path:
    target = path / name
    if not target.is_file():
        raise ModelLoadError(f"{target} is missing{': ' + hint if hint else ''}")
    return target


def read_config(path: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    raw = json.loads(_require(path, "config.json").read_text())
    if raw.get("auto_map") and not trust_remote_code:
        raise ModelLoadError(
            f"{path / 'config.json'} asks for custom code (auto_map); pass --trust-remote-code to allow it"
        )
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{path / 'config.json'} cannot be read: {exc}") from exc


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for shard in shards:
            _require(path, shard, f"listed in {index.name}")
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if any(path.glob("*.bin")):
        raise ModelLoadError(f"{path} has only PyTorch .bin weights; save it with safetensors")
    raise ModelLoadError(f"{path / 'model.safetensors'} is missing (no safetensors weights)")


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def read_chat_template(path: Path, tokenizer) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "processor_config.json"):
        f = path / name
        if f.is_file():
            template = json.loads(f.read_text()).get("chat_template")
            if template:
                return template
    return getattr(tokenizer, "chat_template", None)


def read_checkpoint(path: str | Path, trust_remote_code: bool = False) -> tuple[Checkpoint, type[FamilyAdapter]]:
    from transformers import AutoImageProcessor, AutoTokenizer

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    config = read_config(path, trust_remote_code)
    archs = list(getattr(config, "architectures", None) or [])
    adapter_cls = adapter_for(archs)
    if adapter_cls is None:
        raise UnsupportedArchitectureError(archs or None, supported_architectures(), not_yet_supported(archs))
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(f"{path / 'tokenizer.json'} is missing (no tokenizer files)")
    _require(path, "preprocessor_config.json") if not (path / "processor_config.json").is_file() else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"{path}: tokenizer or image processor cannot be loaded: {exc}") from exc
    processor_config = {}
    if (path / "processor_config.json").is_file():
        processor_config = json.loads((path / "processor_config.json").read_text())
    ckpt = Checkpoint(path, config, tokenizer, image_processor, read_chat_template(path, tokenizer), processor_config)
    return ckpt, adapter_cls


def _dense(tensors: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: t.dequantize(dtype) if isinstance(t, QuantizedWeight) else t for n, t in tensors.items()}


def keeps_packed(device: str) -> bool:
    """Whether a quantized checkpoint's decoder products stay low-bit on ``device``: on a GPU where
    the kernels of :mod:`edgeinfer.quant.kernels` run they do. Elsewhere — a CPU, a GPU without
    Triton, one this Triton cannot build for (:func:`~edgeinfer.quant.kernels.cannot_build`) —
    the weights are dequantized at load, which the profile's memory plan (dense weights) leaves
    room for: rebuilding every weight in torch at every product took 73 times the dense products'
    time for a layer on a CPU (docs/quantization.md, "What happens at load")."""
    where = torch.device(device)
    return where.type == "cuda" and kernels.usable(where)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               trust_remote_code: bool = False, keep_packed: bool | None = None) -> LoadedModel:
    """``keep_packed`` (None: :func:`keeps_packed` of ``device``): a quantized checkpoint's decoder
    products keep their low-bit form; the other quantized layers (a vision tower's) are dequantized."""
    ckpt, adapter_cls = read_checkpoint(path, trust_remote_code)
    adapter = adapter_cls(ckpt)
    scheme = read_quant_scheme(ckpt.path)
    tensors = read_tensors(safetensors_files(ckpt.path))
    quantized = None
    if scheme is not None:
        keep = keeps_packed(device) if keep_packed is None else keep_packed
        tensors, quantized = dequantize_tensors(tensors, scheme, dtype, keep)
    try:
        mapping = rename_weights(tensors, adapter.weight_renames)
        parts = {"vision": {}, "text": {}}
        for name, new in mapping.items():
            head, rest = new.split(".", 1)
            parts[head][rest] = tensors[name]
        decoder = adapter.build_decoder(parts["text"], dtype)
        vision = adapter.build_vision(_dense(parts["vision"], dtype), dtype)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{ckpt.path}: weights do not match {adapter_cls.__name__}: {exc}") from exc
    return LoadedModel(adapter, decoder.to(device), vision.to(device), dtype, ckpt.path.name, quantized)
