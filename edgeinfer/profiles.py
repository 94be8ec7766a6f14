"""Device profiles: the one YAML reader of edgeinfer.

A profile says what one class of device can afford: memory budgets, KV block size and
spill precision, image limits, batching, engine build shapes and server limits. It is
read once into a frozen :class:`DeviceProfile`; every section validates itself in
``__post_init__`` and :class:`DeviceProfile` checks the rules that span sections. Any
mistake is a :class:`~edgeinfer.errors.ProfileError` naming the file and the dotted
field path.

Which profile applies, strongest first: ``--set section.field=value`` overrides, then
``--profile NAME|FILE``, then ``$EDGEINFER_PROFILE``, then detection of this machine.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

import edgeinfer
from edgeinfer.device import DeviceInfo, detect_device
from edgeinfer.errors import ProfileError

PROFILE_ENV = "EDGEINFER_PROFILE"
FINGERPRINT_SCHEMA = 1

DeviceKind = Literal["jetson", "cuda", "cpu"]
HostPrecision = Literal["full", "int8", "fp8"]
RuntimeDevice = Literal["cpu", "cuda"]
RuntimeDtype = Literal["float32", "float16", "bfloat16"]
BuildPrecision = Literal["fp32", "fp16", "bf16", "int8", "int4", "fp8"]  # int4: onnxruntime only

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_POLICY = re.compile(r"^[a-z][a-z0-9-]*$")
_DLA_PRECISIONS = ("fp16", "int8")


# --------------------------------------------------------------------------- checks


def _require(ok: bool, field: str, reason: str) -> None:
    if not ok:
        raise ProfileError(reason, field=field)


def _require_positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(value > 0, name, f"must be > 0, got {value}")


def _require_non_negative(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(value >= 0, name, f"must be >= 0, got {value}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(hint))
    if origin is tuple:
        return f"a list of {_describe(get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _matches(value: object, hint: Any) -> bool:
    origin = get_origin(hint)
    if origin is Literal:
        return isinstance(value, str) and value in get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in get_args(hint))
    if origin is tuple:
        return isinstance(value, tuple) and all(_matches(v, get_args(hint)[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def parse_size(text: str) -> tuple[int, int]:
    """``"1024x768"`` -> (1024, 768)."""
    width, sep, height = text.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise ValueError(f"{text!r} is not WIDTHxHEIGHT in pixels, e.g. '1024x768'")
    return int(width), int(height)


def _check_types(section: object) -> None:
    """Every field holds its declared type; ints given for floats become floats."""
    for name, hint in _hints(type(section)).items():
        value = getattr(section, name)
        _require(_matches(value, hint), name,
                 f"expected {_describe(hint)}, got {_type_name(value)} {value!r}")
        if hint is float:
            object.__setattr__(section, name, float(value))


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True, slots=True)
class DetectRule:
    """How to recognise the device. Patterns are case-insensitive regular expressions:
    ``model_patterns`` against ``/proc/device-tree/model``, ``compatible_patterns``
    against the entries of ``/proc/device-tree/compatible``; memory bounds are MiB of
    MemTotal, ``min`` inclusive and ``max`` exclusive."""

    kind: DeviceKind
    model_patterns: tuple[str, ...] = ()
    compatible_patterns: tuple[str, ...] = ()
    min_memory_mb: int | None = None
    max_memory_mb: int | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("model_patterns", "compatible_patterns"):
            for i, pattern in enumerate(getattr(self, name)):
                _require(_compiles(pattern), f"{name}[{i}]", f"not a valid regular expression: {pattern!r}")
        low, high = self.min_memory_mb, self.max_memory_mb
        _require(low is None or low >= 0, "min_memory_mb", f"must be >= 0, got {low}")
        _require(low is None or high is None or low < high, "max_memory_mb",
                 f"must be above min_memory_mb ({low}), got {high}")

    def matches(self, device: DeviceInfo) -> bool:
        return (device.kind == self.kind and self._names_match(device)
                and self._memory_matches(device.memory_total_mb))

    def _names_match(self, device: DeviceInfo) -> bool:
        if not (self.model_patterns or self.compatible_patterns):
            return True
        by_model = any(re.search(p, device.model or "", re.IGNORECASE) for p in self.model_patterns)
        by_compatible = any(re.search(p, entry, re.IGNORECASE)
                            for p in self.compatible_patterns for entry in device.compatible)
        return by_model or by_compatible

    def _memory_matches(self, total_mb: int) -> bool:
        above = self.min_memory_mb is None or total_mb >= self.min_memory_mb
        below = self.max_memory_mb is None or total_mb < self.max_memory_mb
        return above and below

    @property
    def specificity(self) -> tuple[int, int, int]:
        """Higher wins among matching rules: priority, named rules, narrower memory range."""
        named = int(bool(self.model_patterns or self.compatible_patterns))
        low = self.min_memory_mb or 0
        high = self.max_memory_mb if self.max_memory_mb is not None else 1 << 40
        return (self.priority, named, -(high - low))


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """Budgets in MiB. ``total_mb`` is the device memory the profile was sized for (the
    shared DRAM on unified memory); ``os_reserve_mb`` is never planned for; the KV pool
    gets ``kv_device_budget_mb``; what is left holds weights and activations. Watermarks
    are fractions of the device KV blocks; spill starts above ``high_watermark`` (or when
    MemAvailable falls under ``available_floor_mb``) and stops at ``low_watermark``."""

    total_mb: int
    os_reserve_mb: int
    kv_device_budget_mb: int
    host_tier_mb: int
    disk_tier_mb: int
    high_watermark: float
    low_watermark: float
    available_floor_mb: int
    unified: bool

    def __post_init__(self) -> None:
        _check_types(self)
        _require_positive(self, "total_mb", "kv_device_budget_mb")
        _require_non_negative(self, "os_reserve_mb", "host_tier_mb", "disk_tier_mb", "available_floor_mb")
        _require(self.os_reserve_mb < self.total_mb, "os_reserve_mb",
                 f"{self.os_reserve_mb} MiB leaves nothing of total_mb {self.total_mb}")
        self._check_budgets()
        self._check_watermarks()

    @property
    def plannable_mb(self) -> int:
        return self.total_mb - self.os_reserve_mb

    def _check_budgets(self) -> None:
        _require(self.kv_device_budget_mb <= self.plannable_mb, "kv_device_budget_mb",
                 f"{self.kv_device_budget_mb} MiB is over total_mb - os_reserve_mb = {self.plannable_mb} MiB")
        if self.unified:
            used = self.kv_device_budget_mb + self.host_tier_mb
            _require(used <= self.plannable_mb, "host_tier_mb",
                     f"on unified memory the host tier shares DRAM with the KV pool: "
                     f"kv_device_budget_mb + host_tier_mb = {used} MiB is over {self.plannable_mb} MiB")
        _require(self.available_floor_mb < self.plannable_mb, "available_floor_mb",
                 f"{self.available_floor_mb} MiB is not below total_mb - os_reserve_mb = {self.plannable_mb} MiB")

    def _check_watermarks(self) -> None:
        low, high = self.low_watermark, self.high_watermark
        _require(0 < high <= 1, "high_watermark", f"must be in (0, 1], got {high}")
        _require(0 < low < high, "low_watermark", f"must be in (0, high_watermark={high}), got {low}")


@dataclass(frozen=True, slots=True)
class KVConfig:
    """The paged KV pool. ``device_blocks`` None derives the pool from
    ``memory.kv_device_budget_mb`` (the rule is ``edgeinfer.kv.sizing.pool_blocks``).
    ``policy`` names an eviction policy of the KV package, which validates the name
    against its registry; ``disk_dir`` None means the default cache directory."""

    block_size: int = 16
    device_blocks: int | None = None
    host_precision: HostPrecision = "full"
    disk_dir: str | None = None
    policy: str = "lru-k"

    def __post_init__(self) -> None:
        _check_types(self)
        size = self.block_size
        _require(1 <= size <= 1024 and size & (size - 1) == 0, "block_size",
                 f"must be a power of two between 1 and 1024, got {size}")
        _require(self.device_blocks is None or self.device_blocks > 0, "device_blocks",
                 f"must be > 0 or null, got {self.device_blocks}")
        _require(self.disk_dir is None or bool(self.disk_dir.strip()), "disk_dir", "must be a path or null")
        _require(bool(_POLICY.match(self.policy)), "policy",
                 f"must be a policy name like 'lru-k', got {self.policy!r}")


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Per request: longest side in pixels, pixel count, number of images, encoded size."""

    max_side: int
    max_pixels: int
    max_images: int
    max_file_mb: int

    def __post_init__(self) -> None:
        _check_types(self)
        _require_positive(self, "max_side", "max_pixels", "max_images", "max_file_mb")


# Seconds of load the fused decode step spends choosing its tiles by the whole step's time.
STEP_TUNING_S = 8.0


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Where and how the engine runs; ``threads`` None uses every core."""

    device: RuntimeDevice
    dtype: RuntimeDtype
    max_batch_size: int
    max_context_tokens: int
    prefill_chunk_tokens: int
    threads: int | None = None
    cuda_graphs: bool = False
    # Prompt-length buckets whose prefill graphs are kept (cuda_graphs only; 0: prompts run eagerly).
    prefill_graphs: int = 8
    # Picture sizes ("WIDTHxHEIGHT", e.g. the cameras') the vision tower is compiled for at load.
    vision_compile_sizes: tuple[str, ...] = ()
    # Seconds of start-up spent capturing every decode graph the batch and context buckets allow
    # (cuda_graphs only), so that live traffic never compiles or captures one; 0: each is
    # captured the first time it is needed. Graphs left when the budget runs out are captured then.
    capture_budget_s: float = 0.0
    # Seconds of load the fused decode step (cuda_graphs with Triton) spends choosing its tiles by
    # the whole step's time, after choosing them product by product, at batch 1 (and with
    # $EDGEINFER_ROWS_IN_STEP=1 at each few-row tile of 4-bit layers); 0: product by product only.
    step_tuning_s: float = STEP_TUNING_S

    def __post_init__(self) -> None:
        _check_types(self)
        for size in self.vision_compile_sizes:
            try:
                parse_size(size)
            except ValueError as exc:
                _require(False, "vision_compile_sizes", str(exc))
        _require_positive(self, "max_batch_size", "max_context_tokens", "prefill_chunk_tokens")
        _require(self.prefill_chunk_tokens <= self.max_context_tokens, "prefill_chunk_tokens",
                 f"{self.prefill_chunk_tokens} is over max_context_tokens {self.max_context_tokens}")
        _require(self.threads is None or self.threads >= 1, "threads", f"must be >= 1 or null, got {self.threads}")
        _require(self.prefill_graphs >= 0, "prefill_graphs", f"must be >= 0, got {self.prefill_graphs}")
        _require(self.capture_budget_s >= 0, "capture_budget_s", f"must be >= 0, got {self.capture_budget_s}")
        _require(self.step_tuning_s >= 0, "step_tuning_s", f"must be >= 0, got {self.step_tuning_s}")
        _require(not self.cuda_graphs or self.device == "cuda", "cuda_graphs",
                 "CUDA graphs need device 'cuda'")


@dataclass(frozen=True, slots=True)
class ShapeRange:
    """One dimension of a TensorRT optimization profile."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        _check_types(self)
        _require(self.min >= 1, "min", f"must be >= 1, got {self.min}")
        _require(self.min <= self.opt, "opt", f"must be >= min ({self.min}), got {self.opt}")
        _require(self.opt <= self.max, "max", f"must be >= opt ({self.opt}), got {self.max}")


@dataclass(frozen=True, slots=True)
class BuildConfig:
    """Engine build options. Vision shapes: image side in pixels and images per call.
    Decoder shapes: batch, new tokens per step (1 when decoding, up to the prefill
    chunk) and block-table length."""

    precision: BuildPrecision
    workspace_mb: int
    builder_optimization_level: int
    vision_side: ShapeRange
    vision_batch: ShapeRange
    decoder_batch: ShapeRange
    decoder_tokens: ShapeRange
    decoder_block_table: ShapeRange
    dla_core: int | None = None
    timing_cache: bool = True

    def __post_init__(self) -> None:
        _check_types(self)
        _require_positive(self, "workspace_mb")
        level = self.builder_optimization_level
        _require(0 <= level <= 5, "builder_optimization_level", f"must be in 0..5, got {level}")
        _require(self.dla_core in (None, 0, 1), "dla_core", f"must be 0, 1 or null, got {self.dla_core}")
        _require(self.dla_core is None or self.precision in _DLA_PRECISIONS, "dla_core",
                 f"DLA runs only {' or '.join(_DLA_PRECISIONS)}, precision is {self.precision!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Daemon limits: waiting requests, requests in flight, time and body size. ``idle_sleep_s``:
    after this long without a request the engine sleeps at ``idle_sleep_level`` (1: weights to
    host memory, 2: weights dropped) and the next request wakes it; null never."""

    max_queue: int
    max_concurrent: int
    request_timeout_s: float
    max_body_mb: int
    shutdown_grace_s: float
    idle_sleep_s: float | None = None
    idle_sleep_level: int = 1

    def __post_init__(self) -> None:
        _check_types(self)
        _require_positive(self, "max_queue", "max_concurrent", "request_timeout_s", "max_body_mb")
        _require_non_negative(self, "shutdown_grace_s")
        _require(self.idle_sleep_s is None or self.idle_sleep_s > 0, "idle_sleep_s",
                 f"must be > 0 or null, got {self.idle_sleep_s}")
        _require(self.idle_sleep_level in (1, 2), "idle_sleep_level",
                 f"must be 1 or 2, got {self.idle_sleep_level}")


@dataclass(frozen=True, slots=True)
class PowerLimits:
    """When the board is at its limit, and what the daemon admits then.

    At the limit: the hottest zone whose name matches ``thermal_zone`` (a regular expression)
    is at ``thermal_limit_c`` or above, board input power is at ``power_budget_w`` or above,
    or (``clock_cap_check``) the GPU's clock cap is under what the nvpmodel mode sets. Then
    ``max_concurrent`` and ``max_queue`` fall to the ``throttled_`` values and Retry-After is
    stretched ``retry_factor`` times; readings every ``check_every_s``. A limit left null is
    not checked.
    """

    thermal_zone: str = ".*"
    thermal_limit_c: float | None = None
    power_budget_w: float | None = None
    clock_cap_check: bool = False
    throttled_max_concurrent: int = 1
    throttled_max_queue: int = 2
    retry_factor: float = 4.0
    check_every_s: float = 5.0

    def __post_init__(self) -> None:
        _check_types(self)
        _require(_compiles(self.thermal_zone), "thermal_zone",
                 f"not a valid regular expression: {self.thermal_zone!r}")
        for name in ("thermal_limit_c", "power_budget_w"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, f"must be > 0 or null, got {value}")
        _require_positive(self, "throttled_max_concurrent", "check_every_s")
        _require_non_negative(self, "throttled_max_queue")
        _require(self.retry_factor >= 1, "retry_factor", f"must be >= 1, got {self.retry_factor}")

    @property
    def enabled(self) -> bool:
        return self.thermal_limit_c is not None or self.power_budget_w is not None or self.clock_cap_check


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    description: str
    detect: DetectRule
    memory: MemoryConfig
    kv: KVConfig
    images: ImageLimits
    runtime: RuntimeConfig
    build: BuildConfig
    server: ServerConfig
    power: PowerLimits = PowerLimits()

    def __post_init__(self) -> None:
        _check_types(self)
        _require(bool(_NAME.match(self.name)), "name",
                 f"must be lower-case letters, digits and '-', got {self.name!r}")
        self._check_device()
        if self.power.enabled:
            self._check_throttled_below_server()
        self._check_engine_shapes()
        self._check_body_fits_image()

    def _check_throttled_below_server(self) -> None:
        power, server = self.power, self.server
        _require(power.throttled_max_concurrent <= server.max_concurrent, "power.throttled_max_concurrent",
                 f"{power.throttled_max_concurrent} is over server.max_concurrent {server.max_concurrent}")
        _require(power.throttled_max_queue <= server.max_queue, "power.throttled_max_queue",
                 f"{power.throttled_max_queue} is over server.max_queue {server.max_queue}")

    def _check_device(self) -> None:
        _require(self.detect.kind != "cpu" or self.runtime.device == "cpu", "runtime.device",
                 "a profile detected on CPU-only machines must run on 'cpu'")
        compressed = self.kv.host_precision != "full"
        frees_nothing = self.memory.unified and self.runtime.device == "cuda" and self.memory.host_tier_mb > 0
        _require(compressed or not frees_nothing, "kv.host_precision",
                 "on unified memory a full-precision host tier frees nothing; use 'int8' or 'fp8' "
                 "(or memory.host_tier_mb: 0)")
        _require(self.build.dla_core is None or self.detect.kind == "jetson", "build.dla_core",
                 "DLA cores exist only on Jetson")

    def _check_engine_shapes(self) -> None:
        build, runtime = self.build, self.runtime
        _require(build.decoder_batch.max >= runtime.max_batch_size, "build.decoder_batch.max",
                 f"{build.decoder_batch.max} is under runtime.max_batch_size {runtime.max_batch_size}")
        _require(build.decoder_tokens.max >= runtime.prefill_chunk_tokens, "build.decoder_tokens.max",
                 f"{build.decoder_tokens.max} is under runtime.prefill_chunk_tokens {runtime.prefill_chunk_tokens}")
        needed = math.ceil(runtime.max_context_tokens / self.kv.block_size)
        _require(build.decoder_block_table.max >= needed, "build.decoder_block_table.max",
                 f"{build.decoder_block_table.max} blocks cannot hold runtime.max_context_tokens "
                 f"{runtime.max_context_tokens} at kv.block_size {self.kv.block_size} (needs {needed})")

    def _check_body_fits_image(self) -> None:
        # An image sent as a base64 data URI grows by 4/3.
        needed = math.ceil(self.images.max_file_mb * 4 / 3)
        _require(self.server.max_body_mb >= needed, "server.max_body_mb",
                 f"{self.server.max_body_mb} MiB cannot carry one base64 image of images.max_file_mb "
                 f"{self.images.max_file_mb} (needs {needed})")


# --------------------------------------------------------------------------- YAML → typed


_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_BaseLoader):  # type: ignore[misc,valid-type]
    """safe_load that refuses a key given twice instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ProfileError(f"not valid YAML: {problem}{where}", file=file) from None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ProfileError(f"expected a mapping of {cls.__name__} fields, got {_type_name(data)}",
                           field=path or None)
    known = {f.name: f for f in fields(cls)}
    unknown = [key for key in data if key not in known]
    if unknown:
        raise ProfileError(f"unknown key; valid keys: {', '.join(known)}", field=_join(path, str(unknown[0])))
    required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ProfileError("required key is missing", field=_join(path, missing[0]))
    hints = _hints(cls)
    values = {name: _convert(value, hints[name], _join(path, name)) for name, value in data.items()}
    try:
        return cls(**values)
    except ProfileError as error:
        raise error.located(prefix=path or None) from None


def _convert(value: Any, hint: Any, path: str) -> Any:
    if isinstance(hint, type) and is_dataclass(hint):
        return _build(hint, value, path)
    if get_origin(hint) is tuple and isinstance(value, list):
        return tuple(value)
    return value


def profile_from_mapping(data: Any, *, file: str = "<mapping>") -> DeviceProfile:
    """A validated profile from already-parsed YAML; errors name ``file``."""
    try:
        return _build(DeviceProfile, data, "")
    except ProfileError as error:
        raise error.located(file=file) from None


# --------------------------------------------------------------------------- overrides


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(part.strip() for part in parts):
        raise ProfileError("expected section.field=value", file=f"--set {item}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ProfileError(f"value {text!r} is not valid YAML", file=f"--set {item}",
                           field=key.strip()) from None
    return [part.strip() for part in parts], value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of raw profile data with each ``section.field=value`` set, in order."""
    result = copy.deepcopy(dict(data))
    for item in overrides:
        parts, value = _parse_override(item)
        node: Any = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ProfileError("is a value, not a section", file=f"--set {item}",
                                   field=".".join(parts[: depth + 1]))
            node = child
        node[parts[-1]] = value
    return result


def _override_keys(overrides: Sequence[str]) -> dict[str, str]:
    return {item.partition("=")[0].strip(): item for item in overrides}


def _build_with_overrides(data: Any, overrides: Sequence[str], file: str) -> DeviceProfile:
    base = profile_from_mapping(data, file=file)
    if not overrides:
        return base
    merged = apply_overrides(data, overrides)
    try:
        return _build(DeviceProfile, merged, "")
    except ProfileError as error:
        item = _override_keys(overrides).get(error.field or "")
        label = f"--set {item}" if item else f"{file} with --set {' '.join(overrides)}"
        raise error.located(file=label) from None


# --------------------------------------------------------------------------- files and names


def profile_dirs() -> list[Path]:
    """Where shipped profiles live: inside the wheel first, then the source checkout."""
    package = Path(edgeinfer.__file__).resolve().parent
    candidates = (package / "_profiles", package.parent / "profiles")
    return [path for path in candidates if path.is_dir()]


def list_profiles() -> list[str]:
    names = {path.stem for folder in profile_dirs() for path in folder.glob("*.yaml")}
    return sorted(names)


def _looks_like_file(selector: str) -> bool:
    return selector.endswith((".yaml", ".yml")) or os.sep in selector or "/" in selector


def profile_path(name: str) -> Path:
    """The shipped file of profile ``name``."""
    for folder in profile_dirs():
        path = folder / f"{name}.yaml"
        if path.is_file():
            return path
    raise ProfileError(f"unknown profile {name!r}; available: {', '.join(list_profiles()) or 'none'}")


def read_profile_data(path: str | Path) -> Any:
    """The parsed YAML of a profile file (a fresh copy: callers may change it)."""
    file = str(path)
    try:
        stat = Path(path).stat()
    except OSError as error:
        raise ProfileError(f"cannot read profile file: {error.strerror or error}", file=file) from None
    return copy.deepcopy(_parse_file(file, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=64)
def _parse_file(file: str, mtime_ns: int, size: int) -> Any:
    # mtime and size are part of the key so an edited file is read again.
    try:
        text = Path(file).read_text(encoding="utf-8")
    except OSError as error:
        raise ProfileError(f"cannot read profile file: {error.strerror or error}", file=file) from None
    return _parse_yaml(text, file)


def validate_profile_file(path: str | Path) -> DeviceProfile:
    return profile_from_mapping(read_profile_data(path), file=str(path))


def _load_selected(selector: str, overrides: Sequence[str]) -> DeviceProfile:
    by_name = not _looks_like_file(selector)
    path = profile_path(selector) if by_name else Path(selector)
    profile = _build_with_overrides(read_profile_data(path), overrides, str(path))
    if by_name and profile.name != selector:
        raise ProfileError(f"is {profile.name!r} but the file is named {selector!r}.yaml",
                           file=str(path), field="name")
    return profile


def shipped_profiles() -> list[DeviceProfile]:
    return [validate_profile_file(profile_path(name)) for name in list_profiles()]


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True, slots=True)
class ProfileChoice:
    """Which profile applies and why (for ``profiles detect`` and ``doctor``)."""

    selector: str
    source: Literal["--profile", "env", "detected"]
    reason: str


def match_profile(device: DeviceInfo, profiles: Sequence[DeviceProfile]) -> tuple[DeviceProfile, str]:
    """The most specific profile whose rule matches ``device``.

    A Jetson no profile names falls back to the generic CUDA profile when CUDA works
    there, else to CPU.
    """
    matching = [p for p in profiles if p.detect.matches(device)]
    if matching:
        best = max(matching, key=lambda p: p.detect.specificity)
        return best, f"{device.describe()} matches profile {best.name!r}"
    fallback_kind = "cuda" if device.kind == "cuda" or device.cuda_device else "cpu"
    generic = [p for p in profiles if p.detect.kind == fallback_kind
               and not (p.detect.model_patterns or p.detect.compatible_patterns)]
    if not generic:
        raise ProfileError(f"no profile matches {device.describe()} and no generic "
                           f"{fallback_kind!r} profile is shipped")
    best = max(generic, key=lambda p: p.detect.specificity)
    return best, f"{device.describe()} matches no named profile; using generic {best.name!r}"


def choose_profile(selector: str | None = None, *, env: Mapping[str, str] | None = None,
                   root: str | Path = "/") -> ProfileChoice:
    if selector:
        return ProfileChoice(selector, "--profile", "given with --profile")
    environ = os.environ if env is None else env
    if environ.get(PROFILE_ENV):
        return ProfileChoice(environ[PROFILE_ENV], "env", f"from ${PROFILE_ENV}")
    profile, reason = match_profile(detect_device(root), shipped_profiles())
    return ProfileChoice(profile.name, "detected", reason)


def load_profile(selector: str | None = None, overrides: Sequence[str] = (), *,
                 env: Mapping[str, str] | None = None, root: str | Path = "/") -> DeviceProfile:
    """The profile in force: ``overrides`` > ``selector`` > ``$EDGEINFER_PROFILE`` > detection.

    ``selector`` is a shipped profile name or a path to a YAML file. Each override is
    ``section.field=value`` with the value parsed as YAML and validated like the file.
    """
    choice = choose_profile(selector, env=env, root=root)
    return _load_selected(choice.selector, overrides)


# --------------------------------------------------------------------------- output


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def profile_to_dict(profile: DeviceProfile) -> dict[str, Any]:
    """Plain data (lists, not tuples) that loads back into an equal profile."""
    return _plain(asdict(profile))


def profile_to_yaml(profile: DeviceProfile) -> str:
    return yaml.safe_dump(profile_to_dict(profile), sort_keys=False)


def engine_settings(profile: DeviceProfile) -> dict[str, Any]:
    """The settings a built engine depends on; a change in any means a rebuild."""
    runtime = profile.runtime
    return {
        "schema": FINGERPRINT_SCHEMA,
        "build": _plain(asdict(profile.build)),
        "runtime": {"dtype": runtime.dtype, "max_batch_size": runtime.max_batch_size,
                    "max_context_tokens": runtime.max_context_tokens,
                    "prefill_chunk_tokens": runtime.prefill_chunk_tokens},
        "kv": {"block_size": profile.kv.block_size},
    }


def profile_fingerprint(profile: DeviceProfile) -> str:
    """A stable hash of :func:`engine_settings`: server or spill limits never force a rebuild."""
    canonical = json.dumps(engine_settings(profile), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
