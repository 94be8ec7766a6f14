"""The TensorRT backend: the plans of :mod:`edgeinfer.backends.tensorrt_build` run in-process.

Every tensor is bound by address (``set_tensor_address``) to the torch tensor that holds
it: the KV pools the KV manager allocated are bound by reference and never copied; a step
allocates only its outputs (logits and the new K/V, which the engine writes into the pool
at their slots, as with every backend). Work is enqueued with ``execute_async_v3`` on
torch's current CUDA stream, the stream the spill worker records its compute events on,
so a spill that reads a block waits for the step that wrote it without a device sync.

On unified memory (Jetson) the picture's tensors go to the vision engine from pinned host
memory by address, without a host-to-device copy: there the GPU reads the same DRAM.

Loading never builds: a missing or stale engine is an :class:`EngineBuildError` naming
the ``edgeinfer build --backend tensorrt`` command that makes one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from edgeinfer.backends.onnx_export import (
    DECODER_INPUTS,
    DECODER_OUTPUTS,
    VISION_OUTPUT,
    VisionGraph,
    engine_dir,
    model_fingerprint,
    read_manifest,
    vision_graph_for,
)
from edgeinfer.backends.tensorrt_build import (
    DECODER_PLAN,
    VISION_PLAN,
    EngineFingerprint,
    import_tensorrt,
    stale_engine_reasons,
    tensorrt_build_command,
    trt_logger,
)
from edgeinfer.errors import BackendUnavailableError, EngineBuildError, LimitExceeded

_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT64": torch.int64,
                 "INT32": torch.int32, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


# --------------------------------------------------------------------------- shape limits as data


@dataclass(frozen=True, slots=True)
class ShapeLimits:
    """The optimization profile an engine was built with: {input: (min, max)} from the manifest."""

    ranges: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]

    @classmethod
    def from_manifest(cls, engine: Mapping) -> "ShapeLimits":
        shapes = engine.get("shapes") or {}
        return cls({name: (tuple(s["min"]), tuple(s["max"])) for name, s in shapes.items()})

    def check(self, name: str, shape: tuple[int, ...], field: str) -> None:
        """A LimitExceeded naming the profile field when ``shape`` is outside the built range."""
        low, high = self.ranges[name]
        for axis, (value, lo, hi) in enumerate(zip(shape, low, high)):
            if value > hi or value < lo:
                limit = hi if value > hi else lo
                raise LimitExceeded(f"{name} dim {axis} for the TensorRT engine", value, limit,
                                    override=f"--set {field} and rebuild", reason="engine_shape")


_DECODER_FIELDS = {"inputs_embeds": "build.decoder_batch / build.decoder_tokens",
                   "position_ids": "build.decoder_batch / build.decoder_tokens",
                   "block_tables": "build.decoder_block_table", "context_lens": "build.decoder_batch",
                   "k_pool": "memory.kv_device_budget_mb", "v_pool": "memory.kv_device_budget_mb"}


# --------------------------------------------------------------------------- one engine


class TrtRunner:
    """One deserialized engine and its execution context, run by address on a torch stream."""

    def __init__(self, engine, limits: ShapeLimits, path: Path) -> None:
        self.engine = engine
        self.context = engine.create_execution_context()
        self.limits = limits
        self.path = path
        trt = import_tensorrt()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: _torch_dtype(engine.get_tensor_dtype(n)) for n in names}

    def run(self, feeds: Mapping[str, torch.Tensor], device: torch.device,
            outputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Bind ``feeds`` (contiguous, in the engine's dtypes) and ``outputs`` (allocated here when
        not given) by address and enqueue on the current stream of ``device``."""
        for name in self.inputs:
            tensor = feeds[name]
            if tensor.dtype != self.dtypes[name] or not tensor.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous {self.dtypes[name]} tensor, got {tensor.dtype}")
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise EngineBuildError(f"TensorRT refuses shape {tuple(tensor.shape)} for {name}",
                                       artifact=str(self.path))
            self.context.set_tensor_address(name, tensor.data_ptr())
        bound = dict(outputs or {})
        for name in self.outputs:
            if name not in bound:
                shape = tuple(self.context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineBuildError(f"output {name} has a data-dependent shape {shape}", artifact=str(self.path))
                bound[name] = torch.empty(shape, dtype=self.dtypes[name], device=device)
            self.context.set_tensor_address(name, bound[name].data_ptr())
        if not self.context.execute_async_v3(torch.cuda.current_stream(device).cuda_stream):
            raise EngineBuildError("TensorRT failed to enqueue the engine", artifact=str(self.path))
        return bound


def _torch_dtype(trt_dtype) -> torch.dtype:
    name = getattr(trt_dtype, "name", str(trt_dtype)).split(".")[-1].upper()
    if name not in _TORCH_DTYPES:
        raise EngineBuildError(f"the engine has an I/O tensor of type {name}, which edgeinfer does not bind")
    return _TORCH_DTYPES[name]


# --------------------------------------------------------------------------- the decoder and the vision engine


class TrtDecoderEngine:
    """Decoder engine contract over a TensorRT engine; the pools are bound by reference."""

    def __init__(self, runner: TrtRunner, embed_table: torch.Tensor) -> None:
        if tuple(runner.inputs) != DECODER_INPUTS or set(runner.outputs) != set(DECODER_OUTPUTS):
            raise EngineBuildError(f"decoder engine I/O is {runner.inputs} -> {runner.outputs}, expected "
                                   f"{list(DECODER_INPUTS)} -> {list(DECODER_OUTPUTS)}", artifact=str(runner.path))
        self.runner = runner
        self.embed_table = embed_table

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids.to(self.embed_table.device, non_blocking=True), self.embed_table)

    @torch.inference_mode()
    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens):
        device, dtypes = k_pool.device, self.runner.dtypes
        if k_pool.dtype != dtypes["k_pool"]:
            raise EngineBuildError(f"the engine reads {dtypes['k_pool']} KV pools, the pool is {k_pool.dtype}",
                                   artifact=str(self.runner.path), fix="match runtime.dtype to the build's")
        given = {"inputs_embeds": inputs_embeds, "position_ids": position_ids, "block_tables": block_tables,
                 "context_lens": context_lens}
        # Index inputs take the engine's integer type (int64 as exported, unless TensorRT chose otherwise).
        feeds = {name: t.to(device, dtypes[name], non_blocking=True).contiguous() for name, t in given.items()}
        feeds |= {"k_pool": k_pool, "v_pool": v_pool}
        for name, tensor in feeds.items():
            self.runner.limits.check(name, tuple(tensor.shape), _DECODER_FIELDS[name])
        out = self.runner.run(feeds, device)
        return out["logits"], out["new_k"], out["new_v"]


class TrtVisionEngine:
    """Vision engine contract: the family's host steps around a TensorRT engine.

    Graphs whose rows are independent pictures (tiles, crops) run in chunks of at most the
    engine's largest row count; the others must fit the engine's range in one call.
    """

    def __init__(self, runner: TrtRunner, graph: VisionGraph, device: torch.device, unified: bool,
                 dtype: torch.dtype) -> None:
        self.runner = runner
        self.graph = graph
        self.device = device
        self.unified = unified
        self.dtype = dtype

    @torch.inference_mode()
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        feeds = {name: self._stage(name, t) for name, t in self.graph.feeds(tensors).items()}
        if self.graph.independent_rows:
            rows = len(next(iter(feeds.values())))
            step = min(self.runner.limits.ranges[name][1][0] for name in feeds)
            parts = [self._run({k: v[i:i + step] for k, v in feeds.items()}) for i in range(0, rows, step)]
            output = torch.cat(parts)
        else:
            output = self._run(feeds)
        if self.unified:
            # The pinned feeds go back to torch's host cache when this returns: the engine must be done.
            torch.cuda.current_stream(self.device).synchronize()
        return self.graph.finish(output.float(), tensors).to(self.dtype)

    def _run(self, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
        for name, tensor in feeds.items():
            self.runner.limits.check(name, tuple(tensor.shape), "build.vision_side / build.vision_batch")
        return self.runner.run({k: v.contiguous() for k, v in feeds.items()}, self.device)[VISION_OUTPUT]

    def _stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The feed in the engine's dtype where the engine can read it: pinned host memory on
        unified memory (no copy to the device), device memory otherwise."""
        tensor = tensor.to(self.runner.dtypes[name])
        if self.unified:
            return tensor.contiguous().pin_memory()
        return tensor.to(self.device, non_blocking=True)


# --------------------------------------------------------------------------- opening a build


@dataclass(frozen=True, slots=True)
class TrtEngines:
    decoder: TrtDecoderEngine
    vision: object  # TrtVisionEngine, or the torch vision engine where no vision plan exists
    folder: Path
    manifest: dict


def expected_fingerprint(profile, manifest: Mapping, pool_blocks: int) -> EngineFingerprint:
    """What an engine must have been built for to run here (this TensorRT, GPU 0, the profile,
    a KV pool of ``pool_blocks``)."""
    from edgeinfer.profiles import profile_fingerprint

    trt = import_tensorrt()
    props = torch.cuda.get_device_properties(0)
    return EngineFingerprint(trt.__version__, props.name, f"{props.major}.{props.minor}",
                             profile_fingerprint(profile), (manifest.get("fingerprint") or {}).get("onnx") or {},
                             pool_blocks)


def open_engines(model, profile, config, root: str | Path | None = None, announce: bool = True) -> TrtEngines:
    """The TensorRT engines built for ``model`` and ``profile``; stale or missing ones are refused."""
    trt = import_tensorrt()
    if profile is None:
        raise EngineBuildError("the tensorrt backend runs engines built for a device profile; pass one")
    if not config.device.startswith("cuda") or not torch.cuda.is_available():
        raise BackendUnavailableError(f"TensorRT runs on a CUDA GPU; the profile runs on {config.device!r}"
                                      + ("" if torch.cuda.is_available() else " and torch sees no GPU"))
    model_dir = Path(model.adapter.checkpoint.path).resolve()
    folder = engine_dir(root, model.name, profile.name)
    fix = tensorrt_build_command(model_dir, profile.name)
    manifest = read_manifest(folder)
    if manifest is None:
        raise EngineBuildError("no TensorRT engines built for this model and profile", artifact=str(folder), fix=fix)
    from edgeinfer.engine.engine import pool_blocks

    expected = expected_fingerprint(profile, manifest, pool_blocks(config, model.decoder.cfg))
    reasons = stale_engine_reasons(manifest, folder, expected)
    if manifest.get("fingerprint", {}).get("model") != model_fingerprint(model_dir):
        reasons.append("built from other weights or config (model fingerprint changed)")
    if reasons:
        raise EngineBuildError("stale TensorRT engines: " + "; ".join(reasons), artifact=str(folder), fix=fix)
    runtime = trt.Runtime(trt_logger())
    engines = manifest["tensorrt"]["engines"]
    device = torch.device(config.device if ":" in config.device else "cuda:0")
    decoder = model.decoder
    table = decoder.lm_head_t.t() if decoder.embed is None else decoder.embed
    decoder_engine = TrtDecoderEngine(_runner(runtime, folder / DECODER_PLAN, engines["decoder"]),
                                      table.detach().to(device, config.torch_dtype))
    # What the K/V depends on beyond the checkpoint (precision, plan): the prefix cache keys on it.
    decoder_engine.build_identity = json.dumps(engines["decoder"], sort_keys=True, default=str)
    graph = vision_graph_for(model)
    if "vision" in engines and graph is not None:
        vision = TrtVisionEngine(_runner(runtime, folder / VISION_PLAN, engines["vision"]), graph, device,
                                 config.unified_memory, config.torch_dtype)
    else:
        from edgeinfer.backends.torch_backend import TorchVisionEngine

        vision = TorchVisionEngine(model.vision)
    if announce:
        print(f"tensorrt {trt.__version__}: {folder}", file=sys.stderr)
    return TrtEngines(decoder_engine, vision, folder, manifest)


def _runner(runtime, path: Path, entry: Mapping) -> TrtRunner:
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise EngineBuildError("TensorRT cannot deserialize the engine (its log above says why)", artifact=str(path))
    return TrtRunner(engine, ShapeLimits.from_manifest(entry), path)
