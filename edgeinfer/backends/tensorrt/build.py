"""TensorRT engines from the ONNX graphs of :mod:`edgeinfer.backends.onnx.export`.

A build is planned as data first and run second. :func:`plan_build` turns a device
profile, the inputs of the two ONNX graphs (read with the ``onnx`` package) and what is
known about the target (TensorRT version, GPU, SM, DLA cores, memory) into a
:class:`TensorRTBuildPlan`: per engine, the builder flags, the workspace limit, one
optimization profile (min / opt / max of every input), the network I/O types, DLA
settings, the timing cache file and an estimate of the memory the build needs. Nothing in
the plan imports ``tensorrt``; :func:`build_engine` is the thin part that does.

The engines live beside the graphs they come from, ``<root>/<model>/<profile>/
{vision,decoder}.plan``, and ``manifest.json`` gains a ``tensorrt`` section: the
fingerprint the runtime checks (TensorRT version, GPU name and SM, profile hash, ONNX
hashes) and the hashes of the plan files. A rebuild of the ONNX graphs replaces the whole
folder, plans included.

Shapes of the decoder come straight from the profile: ``batch`` from
``build.decoder_batch``, ``tokens`` from ``build.decoder_tokens``, ``table`` from
``build.decoder_block_table``, ``block_size`` is ``kv.block_size`` and ``blocks`` runs
up to the pool the engine allocates from ``memory.kv_device_budget_mb``. Shapes of the
vision graph depend on the family's processor, so they are measured: square pictures of
the profile's sides go through the adapter's own processor and the graph's host steps,
and the feed shapes at the smallest picture preflight admits, at ``vision_side.opt`` and
at ``vision_side.max`` (times ``vision_batch``) give min, opt and max.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from edgeinfer.artifacts import (
    TENSORRT_SCHEMA,
    Expected,
    Manifest,
    TensorRTFingerprint,
    TensorRTTarget,
    engines_root,
    file_sha256,
    read_manifest,
    stale_reasons,
    write_manifest,
)
from edgeinfer.errors import BackendUnavailableError, EngineBuildError
from edgeinfer.kv.sizing import block_bytes, pool_blocks

VISION_PLAN = "vision.plan"
DECODER_PLAN = "decoder.plan"
TIMING_CACHE_DIR = "timing-cache"
INSTALL_HINT = ("install TensorRT 10.x: on a Jetson it comes with JetPack (sudo apt install python3-libnvinfer), "
                "elsewhere pip install 'edgeinfer[tensorrt]'")

EngineName = Literal["vision", "decoder"]
Triple = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

# Builder flags per profile precision. INT8 and FP8 need scales: a Q/DQ graph, or (INT8 only)
# a calibrator, which TensorRT 10 deprecates and edgeinfer does not ship.
_PRECISION_FLAGS = {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",), "int8": ("INT8", "FP16"),
                    "fp8": ("FP8", "FP16")}
_DTYPE_FLAGS = {"float32": (), "float16": ("FP16",), "bfloat16": ("BF16",)}
# Bytes of a weight at the build precision, over its float32 bytes in the ONNX file.
_WEIGHT_RATIO = {"fp32": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.25, "fp8": 0.25}
# Decoder tensors that carry activations or the KV pools: they take the runtime dtype, so the
# engine reads the pools the KV manager allocates, by address, in their own dtype.
DECODER_FLOAT_IO = ("inputs_embeds", "k_pool", "v_pool", "logits", "new_k", "new_v")
BF16_MIN_SM = (8, 0)  # bf16 kernels need Ampere or newer
SUPPORTED_TENSORRT_MAJOR = 10


# --------------------------------------------------------------------------- the target and the graphs


@dataclass(frozen=True, slots=True)
class BuildTarget:
    """The machine an engine is built on (and for): engines are not portable across these."""

    tensorrt: str
    gpu: str
    sm: str
    dla_cores: int = 0
    unified: bool = False
    host_available_bytes: int | None = None
    device_available_bytes: int | None = None

    @property
    def sm_tuple(self) -> tuple[int, int]:
        major, _, minor = self.sm.partition(".")
        return int(major), int(minor or 0)


@dataclass(frozen=True, slots=True)
class GraphInput:
    """One input of an ONNX graph: each dim an int (static) or a name (dynamic)."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]


@dataclass(frozen=True, slots=True)
class GraphInfo:
    path: Path
    inputs: tuple[GraphInput, ...]
    outputs: tuple[str, ...]
    weight_bytes: int
    has_qdq: bool


def read_graph(path: Path) -> GraphInfo:
    """The inputs, outputs, size on disk (graph + external weights) and Q/DQ presence of a graph."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def dims(value) -> tuple[int | str, ...]:
        return tuple(d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim)

    inputs = tuple(GraphInput(v.name, onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
                              dims(v)) for v in model.graph.input)
    ops = {node.op_type for node in model.graph.node}
    data = path.parent / (path.name + ".data")
    size = path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    return GraphInfo(path, inputs, tuple(v.name for v in model.graph.output), size,
                     {"QuantizeLinear", "DequantizeLinear"} <= ops)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class InputShapes:
    """One input of an optimization profile."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """What building one engine needs, in bytes.

    Host: the parsed network holds the graph's float32 weights, and the serialized engine
    (weights at the build precision) is written from host memory. Device: the weights at
    the build precision while tactics are timed, plus the workspace. On unified memory both
    come out of the same DRAM. An estimate, from the sizes alone.
    """

    host_bytes: int
    device_bytes: int
    unified: bool

    @property
    def total_bytes(self) -> int:
        return self.host_bytes + self.device_bytes

    @classmethod
    def of(cls, weight_bytes: int, precision: str, workspace_bytes: int, unified: bool) -> "MemoryEstimate":
        converted = int(weight_bytes * _WEIGHT_RATIO[precision])
        return cls(weight_bytes + converted, converted + workspace_bytes, unified)


@dataclass(frozen=True, slots=True)
class EnginePlan:
    name: EngineName
    onnx: Path
    plan_file: str
    precision: str
    flags: tuple[str, ...]  # BuilderFlag names to set
    cleared_flags: tuple[str, ...]  # BuilderFlag names on by default to clear (fp32 means no TF32)
    workspace_bytes: int
    optimization_level: int
    shapes: tuple[InputShapes, ...]
    io_dtypes: tuple[tuple[str, str], ...]  # network I/O whose type differs from the graph's
    dla_core: int | None
    timing_cache: Path | None
    memory: MemoryEstimate

    def shape(self, name: str) -> InputShapes:
        return next(s for s in self.shapes if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["onnx"] = self.onnx.name
        data["timing_cache"] = str(self.timing_cache) if self.timing_cache else None
        data["shapes"] = {s.name: {"min": list(s.min), "opt": list(s.opt), "max": list(s.max)} for s in self.shapes}
        data["io_dtypes"] = dict(self.io_dtypes)
        return data


@dataclass(frozen=True, slots=True)
class TensorRTBuildPlan:
    profile: str
    profile_fingerprint: str
    target: BuildTarget
    vision: EnginePlan | None
    decoder: EnginePlan

    @property
    def engines(self) -> tuple[EnginePlan, ...]:
        return tuple(e for e in (self.vision, self.decoder) if e is not None)

    def to_dict(self) -> dict[str, Any]:
        return {e.name: e.to_dict() for e in self.engines}


def timing_cache_path(root: Path, target: BuildTarget) -> Path:
    """One cache per TensorRT version and GPU: TensorRT refuses a cache from another version."""
    gpu = re.sub(r"[^a-z0-9]+", "-", target.gpu.lower()).strip("-")
    return root / TIMING_CACHE_DIR / f"tensorrt-{target.tensorrt}-sm{target.sm.replace('.', '')}-{gpu}.cache"


def precision_flags(profile, target: BuildTarget, graph: GraphInfo, *, float_io: str | None) -> tuple[str, ...]:
    """Builder flags for ``build.precision`` (and a bf16 runtime dtype of the I/O); refuses
    what this graph or GPU cannot build."""
    precision = profile.build.precision
    fix = "--set build.precision=fp16 (or build a Q/DQ graph)"
    if precision not in _PRECISION_FLAGS:
        raise EngineBuildError(f"build.precision {precision} is built by the onnxruntime backend only; TensorRT "
                               f"builds {', '.join(_PRECISION_FLAGS)}", fix="--set build.precision=fp16")
    if precision in ("int8", "fp8") and not graph.has_qdq:
        raise EngineBuildError(
            f"build.precision {precision} needs quantization scales: a calibrated build or a graph with "
            f"QuantizeLinear/DequantizeLinear nodes, and the exported graph has neither", artifact=str(graph.path),
            fix=fix)
    flags = list(_PRECISION_FLAGS[precision])
    for flag in _DTYPE_FLAGS.get(float_io or "float32", ()):
        if flag not in flags:
            flags.append(flag)
    if "BF16" in flags and target.sm_tuple < BF16_MIN_SM:
        raise EngineBuildError(f"bf16 needs a GPU of SM {BF16_MIN_SM[0]}.{BF16_MIN_SM[1]} or newer, "
                               f"{target.gpu} is SM {target.sm}",
                               fix="--set build.precision=fp16 --set runtime.dtype=float16")
    if "FP8" in flags and target.sm_tuple < (8, 9):
        raise EngineBuildError(f"fp8 needs SM 8.9 or newer, {target.gpu} is SM {target.sm}", fix=fix)
    return tuple(flags)


def check_tensorrt_version(target: BuildTarget, profile) -> None:
    """TensorRT 10 is what the build is written for. 11 removed the builder precision flags
    (networks are strongly typed: the graph itself must carry fp16/bf16), so there only a
    float32 build of a float32 runtime is the same engine."""
    major = int(target.tensorrt.split(".")[0])
    if major < SUPPORTED_TENSORRT_MAJOR:
        raise EngineBuildError(f"TensorRT {target.tensorrt} is older than {SUPPORTED_TENSORRT_MAJOR}.0; edgeinfer's "
                               f"engines need TensorRT 10 (JetPack 6.1 or newer on a Jetson)")
    lowered = profile.build.precision != "fp32" or profile.runtime.dtype != "float32"
    if major > SUPPORTED_TENSORRT_MAJOR and lowered:
        raise EngineBuildError(
            f"TensorRT {target.tensorrt} builds strongly typed networks only and has no FP16/BF16/INT8 builder "
            f"flags; edgeinfer exports float32 graphs and lowers their precision with those flags (TensorRT 10)",
            fix="use TensorRT 10.x, or --set build.precision=fp32 --set runtime.dtype=float32")


def decoder_dim_ranges(profile, pool_blocks: int) -> dict[str, tuple[int, int, int]]:
    """min/opt/max of each named dynamic dim of the decoder graph (names of ``decoder_axes``)."""
    build, block_size = profile.build, profile.kv.block_size
    as_triple = lambda r: (r.min, r.opt, r.max)  # noqa: E731
    return {"batch": as_triple(build.decoder_batch), "tokens": as_triple(build.decoder_tokens),
            "table": as_triple(build.decoder_block_table), "block_size": (block_size,) * 3,
            "blocks": (1, pool_blocks, pool_blocks)}


def shapes_from_dim_ranges(graph: GraphInfo, ranges: Mapping[str, tuple[int, int, int]]) -> tuple[InputShapes, ...]:
    """Every input of ``graph`` with its named dims resolved; a dim no range names is an error."""
    shapes = []
    for value in graph.inputs:
        triple: list[list[int]] = [[], [], []]
        for axis, dim in enumerate(value.dims):
            if isinstance(dim, int) and dim > 0:
                values = (dim, dim, dim)
            elif dim in ranges:
                values = ranges[dim]
            else:
                raise EngineBuildError(f"input {value.name!r} has a dynamic dim {axis} ({dim or 'unnamed'}) that no "
                                       f"profile range covers", artifact=str(graph.path))
            for i in range(3):
                triple[i].append(values[i])
        shapes.append(InputShapes(value.name, tuple(triple[0]), tuple(triple[1]), tuple(triple[2])))
    return tuple(shapes)


def shapes_from_samples(graph: GraphInfo, samples: Mapping[str, Sequence[Mapping[str, tuple[int, ...]]]]
                        ) -> tuple[InputShapes, ...]:
    """Every input of ``graph`` from measured feed shapes: ``samples`` holds lists of
    {input: shape} under ``min``, ``opt`` and ``max``; min is the elementwise minimum of its
    list (and of opt), max the maximum of its list (and of opt). Static dims must match."""
    shapes = []
    for value in graph.inputs:
        seen = {k: [s[value.name] for s in samples[k] if value.name in s] for k in ("min", "opt", "max")}
        if not all(seen.values()):
            raise EngineBuildError(f"input {value.name!r} has no measured shape for the optimization profile",
                                   artifact=str(graph.path))
        for shape in (shape for group in seen.values() for shape in group):
            _check_static(graph, value, shape)
        opt = tuple(seen["opt"][0])
        low = tuple(min(d) for d in zip(*seen["min"], opt))
        high = tuple(max(d) for d in zip(*seen["max"], opt))
        shapes.append(InputShapes(value.name, low, opt, high))
    return tuple(shapes)


def _check_static(graph: GraphInfo, value: GraphInput, shape: tuple[int, ...]) -> None:
    if len(shape) != len(value.dims):
        raise EngineBuildError(f"input {value.name!r} is rank {len(value.dims)} in the graph, fed rank {len(shape)}",
                               artifact=str(graph.path))
    for axis, (dim, fed) in enumerate(zip(value.dims, shape)):
        if isinstance(dim, int) and dim > 0 and dim != fed:
            raise EngineBuildError(f"input {value.name!r} dim {axis} is {dim} in the graph, fed {fed}",
                                   artifact=str(graph.path))


def plan_build(profile, target: BuildTarget, decoder: GraphInfo, vision: GraphInfo | None,
               vision_samples: Mapping[str, Sequence[Mapping[str, tuple[int, ...]]]] | None, *, pool_blocks: int,
               root: Path) -> TensorRTBuildPlan:
    """The whole build as data: no TensorRT call, no file written."""
    from edgeinfer.profiles import profile_fingerprint

    build = profile.build
    check_tensorrt_version(target, profile)
    if build.dla_core is not None and build.dla_core >= target.dla_cores:
        raise EngineBuildError(f"build.dla_core {build.dla_core} asks for a DLA core, {target.gpu} has "
                               f"{target.dla_cores}", fix="--set build.dla_core=null")
    cache = timing_cache_path(root, target) if build.timing_cache else None
    workspace = build.workspace_mb * 2**20
    io_dtype = profile.runtime.dtype

    def engine(name: EngineName, graph: GraphInfo, shapes, float_io: str | None, dla: int | None) -> EnginePlan:
        flags = precision_flags(profile, target, graph, float_io=float_io)
        if dla is not None:
            flags = (*flags, "GPU_FALLBACK")
        io = tuple((n, float_io) for n in DECODER_FLOAT_IO if float_io and float_io != "float32"
                   and n in {i.name for i in graph.inputs} | set(graph.outputs))
        cleared = ("TF32",) if build.precision == "fp32" else ()
        return EnginePlan(name, graph.path, VISION_PLAN if name == "vision" else DECODER_PLAN, build.precision,
                          flags, cleared, workspace, build.builder_optimization_level, shapes, io, dla, cache,
                          MemoryEstimate.of(graph.weight_bytes, build.precision, workspace, target.unified))

    decoder_plan = engine("decoder", decoder, shapes_from_dim_ranges(decoder, decoder_dim_ranges(profile, pool_blocks)),
                          io_dtype, None)
    vision_plan = None
    if vision is not None:
        if vision_samples is None:
            raise EngineBuildError("the vision graph needs measured shapes", artifact=str(vision.path))
        vision_plan = engine("vision", vision, shapes_from_samples(vision, vision_samples), None, build.dla_core)
    return TensorRTBuildPlan(profile.name, profile_fingerprint(profile), target, vision_plan, decoder_plan)


# --------------------------------------------------------------------------- measured vision shapes


def vision_samples(graph, adapter, profile) -> dict[str, list[dict[str, tuple[int, ...]]]]:
    """Feed shapes of ``graph`` (a :class:`~edgeinfer.backends.onnx.graphs.VisionGraph`) for
    square gray pictures: the smallest side preflight admits and ``vision_side.min`` at
    ``vision_batch.min`` images, ``vision_side.opt`` at ``.opt``, ``vision_side.max`` at ``.max``."""
    side, batch = profile.build.vision_side, profile.build.vision_batch
    smallest = adapter.image_limits().get("min_side") or 1
    measure = lambda s, b: feed_shapes(graph, adapter, s, b)  # noqa: E731
    return {"min": [measure(max(1, smallest), batch.min), measure(side.min, batch.min)],
            "opt": [measure(side.opt, batch.opt)],
            "max": [measure(side.max, batch.max)]}


def feed_shapes(graph, adapter, side: int, images: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the graph's feeds for ``images`` pictures of ``side`` x ``side`` in one call:
    the processor's tensors of one picture repeated along their first axis, as the family's
    processor stacks several pictures."""
    import torch
    from PIL import Image

    tensors = adapter.process_image(Image.new("RGB", (side, side), (128, 128, 128))).tensors
    stacked = {k: torch.cat([v] * images) if v.dim() else v for k, v in tensors.items()}
    return {name: tuple(t.shape) for name, t in graph.feeds(stacked).items()}


# --------------------------------------------------------------------------- the memory guard


class BuildMemoryError(EngineBuildError):
    """The build would need more memory than the machine has available now."""

    def __init__(self, engine: str, needed_mb: int, available_mb: int, where: str, fix: str) -> None:
        super().__init__(f"building the {engine} engine needs about {needed_mb} MiB of {where} memory, "
                         f"{available_mb} MiB is available", fix=fix)
        self.needed_mb = needed_mb
        self.available_mb = available_mb


def check_build_memory(plan: TensorRTBuildPlan) -> None:
    """Refuse, before TensorRT starts, a build the memory available cannot hold.

    The engines are built one after the other, so each is compared alone. On unified memory
    host and device needs add up against MemAvailable; on a discrete GPU the host part is
    compared with MemAvailable and the device part with the GPU's free memory.
    """
    target, mib = plan.target, 2**20
    fix = ("close other programs, or lower build.workspace_mb in the profile; a larger checkpoint may need a "
           "board with more memory")
    for engine in plan.engines:
        need = engine.memory
        checks = ([(need.total_bytes, target.host_available_bytes, "shared (unified)")] if need.unified else
                  [(need.host_bytes, target.host_available_bytes, "host"),
                   (need.device_bytes, target.device_available_bytes, "GPU")])
        for needed, available, where in checks:
            if available is not None and needed > available:
                raise BuildMemoryError(engine.name, math.ceil(needed / mib), available // mib, where, fix)


# --------------------------------------------------------------------------- the manifest's tensorrt section


def tensorrt_section(plan: TensorRTBuildPlan, fingerprint: TensorRTFingerprint, plans: Mapping[str, str],
                     seconds: Mapping[str, float]) -> dict[str, Any]:
    return {"schema": TENSORRT_SCHEMA, "fingerprint": fingerprint.to_dict(), "plans": dict(plans),
            "engines": plan.to_dict(), "build_seconds": dict(seconds),
            "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# --------------------------------------------------------------------------- TensorRT itself


def import_tensorrt():
    """The ``tensorrt`` module, or a BackendUnavailableError saying what to install."""
    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailableError(f"the tensorrt backend needs the 'tensorrt' Python package, which is not "
                                      f"installed: {INSTALL_HINT}") from None
    return tensorrt


def current_target(*, unified: bool) -> BuildTarget:
    """This machine as a build target: TensorRT, GPU 0 and memory available now."""
    import psutil
    import torch

    trt = import_tensorrt()
    if not torch.cuda.is_available():
        raise BackendUnavailableError("TensorRT needs a CUDA GPU, and torch sees none here")
    props = torch.cuda.get_device_properties(0)
    free, _ = torch.cuda.mem_get_info(0)
    builder = trt.Builder(trt_logger())
    return BuildTarget(trt.__version__, props.name, f"{props.major}.{props.minor}", int(builder.num_DLA_cores),
                       unified, int(psutil.virtual_memory().available), None if unified else int(free))


def with_memory_now(target: BuildTarget) -> BuildTarget:
    """``target`` with the memory available at this moment."""
    import psutil
    import torch

    device = None if target.unified else int(torch.cuda.mem_get_info(0)[0])
    return dataclasses.replace(target, host_available_bytes=int(psutil.virtual_memory().available),
                               device_available_bytes=device)


_LOGGER = None


def trt_logger():
    global _LOGGER  # one logger per process, as TensorRT asks
    if _LOGGER is None:
        trt = import_tensorrt()
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER


def build_engine(plan: EnginePlan, path: Path) -> None:
    """Parse the plan's ONNX graph, build its serialized engine and write it to ``path``
    (the TensorRT part). The parser owns the weights: it lives until the build is done."""
    trt = import_tensorrt()
    builder = trt.Builder(trt_logger())
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, trt_logger())
    if not parser.parse_from_file(str(plan.onnx)):  # reads external weights beside the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT's ONNX parser rejects the graph: {errors}", artifact=str(plan.onnx))
    _set_io_types(trt, network, dict(plan.io_dtypes))
    config = _builder_config(trt, builder, plan)
    cache = _load_timing_cache(config, plan.timing_cache)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError("TensorRT could not build the engine (its log above says why)",
                               artifact=str(plan.onnx))
    if cache is not None and plan.timing_cache is not None:
        _save_timing_cache(config, plan.timing_cache)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(memoryview(serialized))  # no second host copy of the engine
    os.replace(temporary, path)


_TRT_DTYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16"}  # trt.DataType members


def _set_io_types(trt, network, io_dtypes: dict[str, str]) -> None:
    tensors = [network.get_input(i) for i in range(network.num_inputs)]
    tensors += [network.get_output(i) for i in range(network.num_outputs)]
    for tensor in tensors:
        if tensor.name in io_dtypes:
            tensor.dtype = getattr(trt.DataType, _TRT_DTYPES[io_dtypes[tensor.name]])


def _builder_config(trt, builder, plan: EnginePlan):
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    config.builder_optimization_level = plan.optimization_level
    # Layer names and types in the engine, for IEngineInspector (verify_tensorrt.py reads them).
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    for flag in plan.flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for flag in plan.cleared_flags:
        config.clear_flag(getattr(trt.BuilderFlag, flag))
    if plan.dla_core is not None:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = plan.dla_core
    profile = builder.create_optimization_profile()
    for shape in plan.shapes:
        profile.set_shape(shape.name, shape.min, shape.opt, shape.max)
    config.add_optimization_profile(profile)
    return config


def _load_timing_cache(config, path: Path | None):
    if path is None:
        return None
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data)
    # A cache of another TensorRT version or GPU is refused rather than trusted.
    if not config.set_timing_cache(cache, False):  # ignore_mismatch=False
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    return cache


def _save_timing_cache(config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(bytes(config.get_timing_cache().serialize()))
    os.replace(temporary, path)


# --------------------------------------------------------------------------- the build


@dataclass(frozen=True, slots=True)
class TensorRTBuildResult:
    folder: Path
    manifest: Manifest
    skipped: bool
    reasons: tuple[str, ...] = ()
    plan: TensorRTBuildPlan | None = None


def onnx_spec(profile):
    """The ONNX build TensorRT starts from: float32 graphs (TensorRT lowers the precision)."""
    from edgeinfer.backends.onnx.build import BuildSpec
    from edgeinfer.profiles import profile_fingerprint

    shapes = {name: dataclasses.asdict(getattr(profile.build, name)) for name in
              ("vision_side", "vision_batch", "decoder_batch", "decoder_tokens", "decoder_block_table")}
    return BuildSpec(profile.name, profile_fingerprint(profile), "fp32", profile.kv.block_size, shapes)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def pool_blocks_for(profile, decoder_cfg) -> int:
    """The device KV blocks an engine loaded from ``profile`` allocates (the pool's length)."""
    per_block = block_bytes(decoder_cfg.kv_layers, profile.kv.block_size, decoder_cfg.kv_size,
                            _DTYPE_BYTES[profile.runtime.dtype])
    return pool_blocks(profile.memory.kv_device_budget_mb, per_block, profile.kv.device_blocks)


def check_decoder_supported(cfg) -> None:
    """Refuse decoders whose graph the TensorRT runtime does not drive yet: Gemma 3's takes an
    ``image_groups`` input, Gemma 4's is its own graph (``Gemma4DecoderGraph``), and neither
    plan has been built or measured on a GPU."""
    if cfg.gemma_features():
        raise EngineBuildError(f"TensorRT engines are not built for decoders with {', '.join(cfg.gemma_features())} "
                               "(Gemma 3, Gemma 4) yet", fix="--backend onnxruntime (or torch)")


def plan_for_model(model, profile, folder: Path, target: BuildTarget, root: Path) -> TensorRTBuildPlan:
    """The plan of a loaded model whose ONNX graphs are in ``folder``."""
    from edgeinfer.backends.onnx.export import DECODER_FILE, VISION_FILE
    from edgeinfer.backends.onnx.graphs import vision_graph_for

    graph = vision_graph_for(model)
    has_vision = graph is not None and (folder / VISION_FILE).is_file()
    samples = vision_samples(graph, model.adapter, profile) if has_vision else None
    return plan_build(profile, target, read_graph(folder / DECODER_FILE),
                      read_graph(folder / VISION_FILE) if has_vision else None, samples,
                      pool_blocks=pool_blocks_for(profile, model.decoder.cfg), root=root)


def build_tensorrt_engines(model_dir: str | Path, profile, root: str | Path | None = None, *, force: bool = False,
                           progress: bool = True) -> TensorRTBuildResult:
    """Export (or reuse) the ONNX graphs of ``profile``, then build both TensorRT engines.

    Refused before anything is written when TensorRT or a GPU is missing, and before
    TensorRT starts when the plan is invalid or the memory guard says the build would not fit.
    """
    from edgeinfer.backends.onnx.build import GRAPH_FORMAT, Steps, build_engines
    from edgeinfer.models.loader import load_model

    import_tensorrt()
    target = current_target(unified=profile.memory.unified)
    model = load_model(model_dir)
    check_decoder_supported(model.decoder.cfg)
    spec = onnx_spec(profile)
    onnx_result = build_engines(model, spec, root, progress=progress)
    folder = onnx_result.folder
    pool = pool_blocks_for(profile, model.decoder.cfg)
    expected = Expected(spec.profile, spec.profile_fingerprint, graphs=GRAPH_FORMAT,
                        tensorrt=TensorRTTarget(target.tensorrt, target.gpu, target.sm, pool))
    reasons = stale_reasons(onnx_result.manifest, expected)
    if not reasons and not force:
        return TensorRTBuildResult(folder, onnx_result.manifest, skipped=True)
    plan = plan_for_model(model, profile, folder, target, engines_root(root))
    del model, onnx_result  # the builder needs the memory more than the torch weights
    gc.collect()
    plan = dataclasses.replace(plan, target=with_memory_now(plan.target))
    check_build_memory(plan)
    # Until both engines are built, the manifest vouches for none: a failed build leaves no engine to load.
    document = read_manifest(folder).to_json()
    document.pop("tensorrt", None)
    document["fingerprint"] |= {"tensorrt": None, "sm": None, "gpu": None}  # what doctor reads of the build
    write_manifest(folder, document)
    fingerprint = TensorRTFingerprint(target.tensorrt, target.gpu, target.sm, spec.profile_fingerprint,
                                    document["fingerprint"]["onnx"], pool)
    plans, seconds = {}, {}
    with Steps(len(plan.engines) + 1, f"tensorrt {folder.parent.name}/{profile.name}", progress) as bar:
        for engine in plan.engines:
            bar.step(f"building the {engine.name} engine ({', '.join(engine.flags) or 'fp32'})")
            started = datetime.datetime.now()
            build_engine(engine, folder / engine.plan_file)
            seconds[engine.name] = round((datetime.datetime.now() - started).total_seconds(), 1)
            plans[engine.plan_file] = file_sha256(folder / engine.plan_file, remember=True)
            bar.done()
        bar.step("writing the manifest")
        document["tensorrt"] = tensorrt_section(plan, fingerprint, plans, seconds)
        document["fingerprint"] |= {"tensorrt": target.tensorrt, "sm": target.sm, "gpu": target.gpu}
        manifest = write_manifest(folder, document)
        bar.done()
    return TensorRTBuildResult(folder, manifest, skipped=False, reasons=tuple(reasons), plan=plan)
