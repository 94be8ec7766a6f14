"""A checkpoint's ``quantization_config`` (config.json) read into a typed scheme.

Three weight-only formats are read: compressed-tensors ``pack-quantized`` (what llm-compressor
writes for W4A16 / W8A16), GPTQ and AWQ's GEMM layout. Anything else is refused with
:class:`~edgeinfer.errors.UnsupportedQuantizationError`, which lists :data:`SUPPORTED`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from edgeinfer.errors import ModelLoadError, UnsupportedQuantizationError


class QuantMethod(str, Enum):
    COMPRESSED_TENSORS = "compressed-tensors"
    GPTQ = "gptq"
    AWQ = "awq"


SUPPORTED = [
    ("compressed-tensors pack-quantized (int 4 or 8 bit weights, group or channel strategy, "
     "symmetric or asymmetric, no activation quantization)"),
    "gptq (4 or 8 bit, group_size or -1, desc_act with g_idx, sym or asym; checkpoint_format gptq or gptq_v2)",
    "awq (version gemm, 4 bit, zero_point true)",
]

# GPTQ stores each zero point minus one ("gptq", the classic layout AutoGPTQ and Qwen's
# published checkpoints use); "gptq_v2" (GPTQModel's own) stores it as it is.
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How one group of linear layers stores its weights."""

    bits: int
    group_size: int | None  # input columns per scale; None: one scale per output row (channel)
    symmetric: bool
    # compressed-tensors: the config group's targets (layer names, ``re:`` patterns or class names)
    targets: tuple[str, ...] = ()
    desc_act: bool = False  # GPTQ act-order: input columns are grouped through ``g_idx``

    def matches(self, module: str, by_name: bool = False) -> bool:
        """Whether ``module`` (a checkpoint layer name) falls under this group's targets. A class
        name (``Linear``) matches every layer: the checkpoint's tensors say which layers are packed.
        With ``by_name`` only a name or ``re:`` target counts."""
        if by_name:
            return any(not _is_class(t) and _target_matches(t, module) for t in self.targets)
        return not self.targets or any(_target_matches(t, module) for t in self.targets)


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """A checkpoint's whole quantization config."""

    method: QuantMethod
    groups: tuple[WeightScheme, ...]
    ignore: tuple[str, ...] = ()
    gptq_zeros_minus_one: bool = True  # only GPTQ: "gptq" (classic) rather than "gptq_v2"

    @property
    def label(self) -> str:
        """A short name for doctor and logs: ``compressed-tensors W4A16 g32``, ``gptq W8A16 channel``;
        a group that names its layers says which (``compressed-tensors W8A16 channel (lm_head), W4A16 g128``)."""
        parts = [f"W{g.bits}A16 {'g' + str(g.group_size) if g.group_size else 'channel'}"
                 f"{'' if g.symmetric else ' asym'}{' act-order' if g.desc_act else ''}{_named_targets(g)}"
                 for g in self.groups]
        return f"{self.method.value} " + ", ".join(parts)

    def ignores(self, module: str) -> bool:
        return any(_target_matches(t, module) for t in self.ignore)

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The weight scheme of ``module``, or None when the config leaves it unquantized."""
        if self.ignores(module):
            return None
        # A group that names the layer wins over one that targets its class, as in compressed-tensors
        # (which also renumbers the groups it writes, so their order says nothing).
        named = next((g for g in self.groups if g.matches(module, by_name=True)), None)
        return named or next((g for g in self.groups if g.matches(module)), None)


def _named_targets(group: WeightScheme) -> str:
    """`` (lm_head)`` for a group whose targets name layers; nothing for one that targets a class."""
    names = [t for t in group.targets if not _is_class(t)]
    return f" ({', '.join(names)})" if names else ""


def _is_class(target: str) -> bool:
    """A class name such as ``Linear`` (not a layer name or a regex)."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _target_matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if _is_class(target):
        return True
    # a layer name or a part of one (AWQ's modules_to_not_convert lists "visual", "lm_head")
    return f".{target}." in f".{module}."


def read_quant_scheme(model_dir: str | Path) -> QuantScheme | None:
    """The scheme of the checkpoint in ``model_dir``, or None when its weights are not quantized."""
    config_file = Path(model_dir) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} cannot be read: {exc}") from exc
    config = raw.get("quantization_config") or raw.get("compression_config")
    return None if config is None else parse_quant_config(config)


def parse_quant_config(config: dict[str, Any]) -> QuantScheme:
    """A ``quantization_config`` dict -> :class:`QuantScheme`; unknown formats are refused."""
    if not isinstance(config, dict):
        raise UnsupportedQuantizationError(f"{config!r} (not a mapping)", SUPPORTED)
    method = str(config.get("quant_method", "")).lower()
    if method == QuantMethod.COMPRESSED_TENSORS.value:
        return _compressed_tensors(config)
    if method == QuantMethod.GPTQ.value:
        return _gptq(config)
    if method == QuantMethod.AWQ.value:
        return _awq(config)
    raise UnsupportedQuantizationError(f"quant_method {method or '(missing)'!r}", SUPPORTED)


def _compressed_tensors(config: dict[str, Any]) -> QuantScheme:
    default_format = config.get("format")
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        groups.append(_compressed_tensors_group(name, group, group.get("format") or default_format))
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors without config_groups", SUPPORTED)
    return QuantScheme(QuantMethod.COMPRESSED_TENSORS, tuple(groups), tuple(config.get("ignore") or ()))


def _compressed_tensors_group(name: str, group: dict[str, Any], fmt: str | None) -> WeightScheme:
    where = f"compressed-tensors config group {name!r}"
    if fmt != "pack-quantized":
        raise UnsupportedQuantizationError(f"{where} with format {fmt!r}", SUPPORTED)
    weights = group.get("weights") or {}
    if group.get("input_activations") or group.get("output_activations"):
        raise UnsupportedQuantizationError(f"{where} quantizing activations (only weight-only W4A16/W8A16)", SUPPORTED)
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind != "int" or bits not in (4, 8) or strategy not in ("group", "channel") or weights.get("dynamic"):
        raise UnsupportedQuantizationError(
            f"{where}: {kind} {bits}-bit weights, strategy {strategy!r}, dynamic {weights.get('dynamic')}", SUPPORTED)
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise UnsupportedQuantizationError(f"{where}: group strategy with group_size {group_size!r}", SUPPORTED)
    return WeightScheme(int(bits), group_size, bool(weights.get("symmetric", True)), tuple(group.get("targets") or ()),
                        desc_act=weights.get("actorder") == "group")


def _gptq(config: dict[str, Any]) -> QuantScheme:
    bits, group_size = config.get("bits"), config.get("group_size", 128)
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if bits not in (4, 8) or fmt not in GPTQ_CHECKPOINT_FORMATS or not isinstance(group_size, int) or group_size == 0:
        raise UnsupportedQuantizationError(
            f"gptq with bits {bits!r}, group_size {group_size!r}, checkpoint_format {fmt!r}", SUPPORTED)
    scheme = WeightScheme(int(bits), None if group_size < 0 else group_size, bool(config.get("sym", True)),
                          desc_act=bool(config.get("desc_act", False)))
    return QuantScheme(QuantMethod.GPTQ, (scheme,), _not_converted(config), gptq_zeros_minus_one=fmt == "gptq")


def _awq(config: dict[str, Any]) -> QuantScheme:
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size"))
    version = str(config.get("version", "gemm")).lower()
    zero_point = config.get("zero_point", True)
    if version != "gemm" or bits != 4 or not zero_point or not isinstance(group_size, int) or group_size <= 0:
        raise UnsupportedQuantizationError(
            f"awq version {version!r} with bits {bits!r}, group_size {group_size!r}, zero_point {zero_point!r}",
            SUPPORTED)
    return QuantScheme(QuantMethod.AWQ, (WeightScheme(4, group_size, False),), _not_converted(config))


def _not_converted(config: dict[str, Any]) -> tuple[str, ...]:
    return tuple(config.get("modules_to_not_convert") or ())
