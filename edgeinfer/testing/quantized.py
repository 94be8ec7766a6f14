"""Quantized copies of the tiny test checkpoints, in the layouts the published tools write.

- :func:`quantize_compressed_tensors` goes through compressed-tensors itself, the way
  llm-compressor saves a model: the scheme applied to the model's linear layers, min-max scales
  and zero points (``calculate_qparams``), then ``ModelCompressor`` compresses and writes the
  ``quantization_config``.
- :func:`quantize_gptq` and :func:`quantize_awq` round to nearest and pack by the published
  layouts (AutoGPTQ / GPTQModel's ``qweight`` packed along input rows with ``g_idx``; AutoAWQ's
  GEMM ``qweight`` packed along output columns in the order 0, 2, 4, 6, 1, 3, 5, 7).

Only the language model's linear layers are quantized; the vision tower, projector and
``lm_head`` stay dense, as the published recipes for these models leave them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

# Layers llm-compressor's vision-language recipes leave dense: the head, the vision tower and projector.
VISION_AND_HEAD = ("lm_head", "re:.*visual.*", "re:.*vision.*", "re:.*multi_modal_projector.*",
                   "re:.*connector.*", "re:.*mlp1.*")
_TEXT_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_VISION = re.compile(r"vision|visual")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer, processor and template files: everything of ``src`` that ``out`` lacks."""
    for f in src.iterdir():
        if f.is_file() and not (out / f.name).exists() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)


def quantize_compressed_tensors(src: str | Path, out: str | Path, *, bits: int = 4, group_size: int | None = 32,
                                symmetric: bool = True, dtype: torch.dtype | None = None) -> Path:
    """A compressed-tensors ``pack-quantized`` copy of ``src`` (group strategy, or channel
    when ``group_size`` is None), written as llm-compressor writes it; ``dtype``: the model loaded
    in that dtype first, so the copy's weights and scales are in it (as a bf16 checkpoint's are)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForImageTextToText

    src, out = Path(src), Path(out)
    model = AutoModelForImageTextToText.from_pretrained(src, **({"dtype": dtype} if dtype else {})).eval()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size else "channel", group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=list(VISION_AND_HEAD))
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            weight = module.weight
            grouped = weight.unflatten(-1, (-1, group_size)) if group_size else weight.unsqueeze(1)
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_side_files(src, out)
    return out


def text_linear_names(names) -> list[str]:
    """The language model's linear weights among checkpoint tensor ``names``."""
    return sorted(n for n in names if _TEXT_LINEAR.search(n) and not _VISION.search(n))


def round_to_nearest(weight: torch.Tensor, bits: int, group: torch.Tensor, symmetric: bool):
    """Min-max round-to-nearest of ``weight`` [out, in] with input column ``i`` in group
    ``group[i]``: (codes [out, in] 0..2^b-1, zeros [out, groups], scales [out, groups] fp16)."""
    maxq = (1 << bits) - 1
    groups = int(group.max()) + 1
    lo = torch.stack([weight[:, group == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([weight[:, group == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    if symmetric:
        scales = torch.maximum(lo.abs(), hi) * 2 / maxq
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        scales = (hi - lo) / maxq
        zeros = torch.round(-lo / scales.clamp(min=1e-8)).clamp(0, maxq)
    scales = scales.clamp(min=1e-8).half()
    codes = torch.round(weight / scales.float()[:, group]) + zeros[:, group]
    return codes.clamp(0, maxq).to(torch.int64), zeros.to(torch.int64), scales


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] -> [rows*b/32, cols]: row ``r*32/b + j`` in bits ``b*j`` of word ``r``."""
    per = 32 // bits
    words = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= values[j::per] << (bits * j)
    return _to_int32(words)


def pack_columns(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[rows, cols] -> [rows, cols*b/32]: bits ``b*i`` of word ``c`` hold column
    ``c*32/b + order[i]`` (``order`` the identity unless given)."""
    per = 32 // bits
    order = order or range(per)
    words = torch.zeros(values.shape[0], values.shape[1] // per, dtype=torch.int64)
    for i, column in enumerate(order):
        words |= values[:, column::per] << (bits * i)
    return _to_int32(words)


def _write(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    _copy_side_files(src, out)
    return out


def _read(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(src / "model.safetensors")


def quantize_gptq(src: str | Path, out: str | Path, *, bits: int = 4, group_size: int = 32, symmetric: bool = True,
                  desc_act: bool = False, seed: int = 0) -> Path:
    """A GPTQ copy of ``src``. With ``desc_act`` the input columns are grouped in a seeded
    random order recorded in ``g_idx`` (act-order). Symmetric checkpoints use the classic
    ``gptq`` format (zeros stored minus one); asymmetric ones ``gptq_v2``, which stores a
    zero of 0 faithfully where the classic format cannot."""
    src, out = Path(src), Path(out)
    tensors = _read(src)
    minus_one = symmetric
    gen = torch.Generator().manual_seed(seed)
    for name in text_linear_names(tensors):
        weight = tensors.pop(name).float()
        cols = weight.shape[1]
        order = torch.randperm(cols, generator=gen) if desc_act else torch.arange(cols)
        g_idx = torch.empty(cols, dtype=torch.int64)
        g_idx[order] = torch.arange(cols) // group_size
        codes, zeros, scales = round_to_nearest(weight, bits, g_idx, symmetric)
        layer = name.removesuffix(".weight")
        tensors[f"{layer}.qweight"] = pack_rows(codes.t(), bits)
        tensors[f"{layer}.qzeros"] = pack_columns(((zeros - 1) if minus_one else zeros).t() & ((1 << bits) - 1), bits)
        tensors[f"{layer}.scales"] = scales.t()
        tensors[f"{layer}.g_idx"] = g_idx.to(torch.int32)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": symmetric,
              "checkpoint_format": "gptq" if minus_one else "gptq_v2", "damp_percent": 0.01, "true_sequential": True,
              "static_groups": False}
    return _write(src, out, tensors, config)


def quantize_awq(src: str | Path, out: str | Path, *, group_size: int = 32) -> Path:
    """An AutoAWQ GEMM copy of ``src`` (4-bit, zero point, scales fp16)."""
    src, out = Path(src), Path(out)
    tensors = _read(src)
    for name in text_linear_names(tensors):
        weight = tensors.pop(name).float()
        group = torch.arange(weight.shape[1]) // group_size
        codes, zeros, scales = round_to_nearest(weight, 4, group, symmetric=False)
        layer = name.removesuffix(".weight")
        tensors[f"{layer}.qweight"] = pack_columns(codes.t(), 4, AWQ_PACK_ORDER)
        tensors[f"{layer}.qzeros"] = pack_columns(zeros.t(), 4, AWQ_PACK_ORDER)
        tensors[f"{layer}.scales"] = scales.t()
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True,
              "modules_to_not_convert": ["visual", "vision_tower", "vision_model", "multi_modal_projector", "lm_head"]}
    return _write(src, out, tensors, config)
