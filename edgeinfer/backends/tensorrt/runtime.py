"""The TensorRT backend: the plans of :mod:`edgeinfer.backends.tensorrt.build` run in-process.

Every tensor is bound by address (``set_tensor_address``) to the torch tensor that holds
it: the KV pools the KV manager allocated are bound by reference and never copied; a step
allocates only its outputs (logits and the new K/V, which the engine writes into the pool
at their slots, as with every backend). Work is enqueued with ``execute_async_v3`` on
torch's current CUDA stream, the stream the spill worker records its compute events on,
so a spill that reads a block waits for the step that wrote it without a device sync.

On unified memory (Jetson) the picture's tensors go to the vision engine from pinned host
memory by address, without a host-to-device copy: there the GPU reads the same DRAM.

With ``runtime.cuda_graphs``, decode steps (one new token per row) replay from CUDA graphs,
bucketed by batch and block-table width as the torch backend buckets them
(:mod:`edgeinfer.backends.torch.cuda_graphs`); prefill stays eager. A graph bakes in the shapes and
tensor addresses its execution context had when it was captured, so every graph has a
context of its own, bound once to the graph's static buffers and to the KV pools. Those
contexts own no activation memory: they share one scratch buffer, which is safe because
they all run on the one stream, one at a time. A step no graph covers, or any capture that
fails, runs eagerly: the failure is warned about once and graphs stay off.

Loading never builds: a missing or stale engine is an :class:`EngineBuildError` naming
the ``edgeinfer build --backend tensorrt`` command that makes one.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from edgeinfer.artifacts import (
    Expected,
    Manifest,
    PlanEntry,
    TensorRTTarget,
    build_command,
    checkpoint_fingerprint,
    engine_dir,
    read_manifest,
    stale_reasons,
)
from edgeinfer.backends.onnx.graphs import DECODER_INPUTS, DECODER_OUTPUTS, VISION_OUTPUT, VisionGraph, vision_graph_for
from edgeinfer.backends.tensorrt.build import DECODER_PLAN, VISION_PLAN, import_tensorrt, trt_logger
from edgeinfer.backends.torch.cuda_graphs import bucket_for, buckets
from edgeinfer.errors import BackendUnavailableError, EngineBuildError, LimitExceeded
from edgeinfer.kv.sizing import block_bytes, pool_blocks
from edgeinfer.models.decoder import widen_embeds

_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT64": torch.int64,
                 "INT32": torch.int32, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


# --------------------------------------------------------------------------- shape limits as data


@dataclass(frozen=True, slots=True)
class ShapeLimits:
    """The optimization profile an engine was built with: {input: (min, max)} from the manifest."""

    ranges: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]

    @classmethod
    def from_manifest(cls, engine: PlanEntry) -> "ShapeLimits":
        return cls({name: (shape.min, shape.max) for name, shape in engine.shapes.items()})

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
        bound = self.bind(self.context, feeds, device, outputs)
        self.enqueue(self.context, torch.cuda.current_stream(device))
        return bound

    def bind(self, context, feeds: Mapping[str, torch.Tensor], device: torch.device,
             outputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Set ``context``'s input shapes and every tensor address; the outputs, allocated where not given."""
        for name in self.inputs:
            tensor = feeds[name]
            if tensor.dtype != self.dtypes[name] or not tensor.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous {self.dtypes[name]} tensor, got {tensor.dtype}")
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise EngineBuildError(f"TensorRT refuses shape {tuple(tensor.shape)} for {name}",
                                       artifact=str(self.path))
            context.set_tensor_address(name, tensor.data_ptr())
        bound = dict(outputs or {})
        for name in self.outputs:
            if name not in bound:
                shape = tuple(context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineBuildError(f"output {name} has a data-dependent shape {shape}", artifact=str(self.path))
                bound[name] = torch.empty(shape, dtype=self.dtypes[name], device=device)
            context.set_tensor_address(name, bound[name].data_ptr())
        return bound

    def enqueue(self, context, stream: torch.cuda.Stream) -> None:
        if not context.execute_async_v3(stream.cuda_stream):
            raise EngineBuildError("TensorRT failed to enqueue the engine", artifact=str(self.path))

    def scratch_bytes(self) -> int:
        """Activation memory one execution context needs at the largest shapes the engine takes."""
        # device_memory_size_v2 is TensorRT 10.1's name (64-bit); 10.0 has only the older one.
        size = getattr(self.engine, "device_memory_size_v2", None)
        return int(size if size is not None else self.engine.device_memory_size)

    def context_on(self, scratch: torch.Tensor):
        """A new execution context that keeps its activations in ``scratch`` rather than memory of its own."""
        trt = import_tensorrt()
        context = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise EngineBuildError("TensorRT cannot create another execution context", artifact=str(self.path))
        if hasattr(context, "set_device_memory"):  # TensorRT 10.1+: the size is checked
            context.set_device_memory(scratch.data_ptr(), scratch.numel())
        else:
            context.device_memory = scratch.data_ptr()
        return context


def _torch_dtype(trt_dtype) -> torch.dtype:
    name = getattr(trt_dtype, "name", str(trt_dtype)).split(".")[-1].upper()
    if name not in _TORCH_DTYPES:
        raise EngineBuildError(f"the engine has an I/O tensor of type {name}, which edgeinfer does not bind")
    return _TORCH_DTYPES[name]


# --------------------------------------------------------------------------- decode steps in CUDA graphs


def clipped_buckets(low: int, high: int, start: int = 1) -> tuple[int, ...]:
    """The torch backend's power-of-two buckets up to ``high``, each raised to ``low`` and capped
    at ``high``: every bucket is a size the engine was built to take."""
    return tuple(sorted({min(max(b, low), high) for b in buckets(high, start)}))


@dataclass(frozen=True, slots=True)
class DecodeGraphPlan:
    """Which decoder steps replay from a CUDA graph, and the static input shapes of each graph."""

    batches: tuple[int, ...]
    widths: tuple[int, ...]
    hidden: int
    mrope: bool  # position_ids is [3, batch, tokens]

    @classmethod
    def for_engine(cls, limits: ShapeLimits, enabled: bool) -> DecodeGraphPlan | None:
        """The plan for an engine built with ``limits``; None when graphs are off (the profile's
        ``runtime.cuda_graphs``) or the engine takes no single-token step."""
        (batch_lo, tokens_lo, hidden), (batch_hi, tokens_hi, _) = limits.ranges["inputs_embeds"]
        if not enabled or not tokens_lo <= 1 <= tokens_hi:
            return None
        (_, width_lo), (_, width_hi) = limits.ranges["block_tables"]
        return cls(clipped_buckets(batch_lo, batch_hi), clipped_buckets(width_lo, width_hi, start=8), hidden,
                   len(limits.ranges["position_ids"][0]) == 3)

    def bucket(self, batch: int, tokens: int, width: int) -> tuple[int, int] | None:
        """The (batch, width) graph a step of this shape replays from; None: it runs eagerly."""
        if tokens != 1:
            return None
        rows, columns = bucket_for(batch, list(self.batches)), bucket_for(width, list(self.widths))
        return None if rows is None or columns is None else (rows, columns)

    def input_shapes(self, bucket: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """Shapes of the graph's static inputs; the KV pools are bound as they are."""
        batch, width = bucket
        return {"inputs_embeds": (batch, 1, self.hidden), "position_ids": (3, batch, 1) if self.mrope else (batch, 1),
                "block_tables": (batch, width), "context_lens": (batch,)}


@dataclass
class _TrtGraph:
    graph: torch.cuda.CUDAGraph
    context: object  # the IExecutionContext whose shapes and addresses the graph baked in
    feeds: dict[str, torch.Tensor]  # static inputs; padding rows keep context_lens 0
    outputs: dict[str, torch.Tensor]
    pools: tuple[int, int]  # the KV pool addresses bound at capture

    def load(self, given: Mapping[str, torch.Tensor]) -> None:
        """Copy a step's inputs into the leading rows and columns (converting dtype and device); zero the rest."""
        for name, static in self.feeds.items():
            value = given[name]
            static.zero_()
            static[tuple(slice(0, n) for n in value.shape)].copy_(value, non_blocking=True)

    def replay(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.graph.replay()
        out = self.outputs
        return out["logits"][:rows], out["new_k"][:, :rows], out["new_v"][:, :rows]


class TrtDecodeGraphs:
    """The decode steps of one decoder engine, captured per (batch, width) bucket on first use.

    One execution context per graph: a context holds one set of shapes and addresses, and a
    graph replays what its context had at capture, so re-setting a shared context before a
    replay would change nothing the graph does. The contexts are created without activation
    memory and share one scratch buffer of the engine's largest need: graphs replay on the
    one stream, one after another, so no two use it at once.
    """

    def __init__(self, runner: TrtRunner, plan: DecodeGraphPlan) -> None:
        self.runner = runner
        self.plan = plan
        self.graphs: dict[tuple[int, int], _TrtGraph] = {}
        self.error: str | None = None  # why capturing failed; graphs stay off after one failure
        self._scratch: torch.Tensor | None = None
        self._pool = None  # the graphs share one torch memory pool, as the torch backend's do

    def graph_for(self, bucket: tuple[int, int], k_pool: torch.Tensor, v_pool: torch.Tensor) -> _TrtGraph | None:
        """The graph of ``bucket`` over these pools, captured on first use; None to run eagerly."""
        if self.error is not None:
            return None
        graph = self.graphs.get(bucket)
        if graph is None:
            try:
                graph = self.graphs[bucket] = self._capture(bucket, k_pool, v_pool)
            except Exception as exc:  # noqa: BLE001 - the eager step is always correct; keep it
                self.error = f"{type(exc).__name__}: {exc}"[:500]
                warnings.warn(f"TensorRT decode steps run without CUDA graphs, capture failed: {self.error}")
                return None
        return graph if graph.pools == (k_pool.data_ptr(), v_pool.data_ptr()) else None

    def _capture(self, bucket: tuple[int, int], k_pool: torch.Tensor, v_pool: torch.Tensor) -> _TrtGraph:
        device, runner = k_pool.device, self.runner
        if self._scratch is None:
            self._scratch = torch.empty(max(runner.scratch_bytes(), 256), dtype=torch.uint8, device=device)
        feeds = {name: torch.zeros(shape, dtype=runner.dtypes[name], device=device)
                 for name, shape in self.plan.input_shapes(bucket).items()}
        context = runner.context_on(self._scratch)
        outputs = runner.bind(context, feeds | {"k_pool": k_pool, "v_pool": v_pool}, device)
        # TensorRT applies new shapes and addresses at the next enqueue, which must not be the
        # captured one. This run reads zeros (every row is padding) and writes only the outputs.
        runner.enqueue(context, torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        # thread_local: the spill worker's CUDA calls on its own thread do not break the capture.
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            runner.enqueue(context, torch.cuda.current_stream(device))  # torch's capture stream
        self._pool = graph.pool()
        return _TrtGraph(graph, context, feeds, outputs, (k_pool.data_ptr(), v_pool.data_ptr()))


# --------------------------------------------------------------------------- the decoder and the vision engine


class TrtDecoderEngine:
    """Decoder engine contract over a TensorRT engine; the pools are bound by reference.

    With a :class:`DecodeGraphPlan`, decode steps replay from CUDA graphs; the logits and new
    K/V are then views of the graph's static outputs, valid until the next step.
    """

    def __init__(self, runner: TrtRunner, embed_table: torch.Tensor, graphs: DecodeGraphPlan | None = None) -> None:
        if tuple(runner.inputs) != DECODER_INPUTS or set(runner.outputs) != set(DECODER_OUTPUTS):
            raise EngineBuildError(f"decoder engine I/O is {runner.inputs} -> {runner.outputs}, expected "
                                   f"{list(DECODER_INPUTS)} -> {list(DECODER_OUTPUTS)}", artifact=str(runner.path))
        self.runner = runner
        self.embed_table = embed_table
        self.graphs = TrtDecodeGraphs(runner, graphs) if graphs is not None else None

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids.to(self.embed_table.device, non_blocking=True), self.embed_table)

    @torch.inference_mode()
    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens):
        dtypes = self.runner.dtypes
        if k_pool.dtype != dtypes["k_pool"]:
            raise EngineBuildError(f"the engine reads {dtypes['k_pool']} KV pools, the pool is {k_pool.dtype}",
                                   artifact=str(self.runner.path), fix="match runtime.dtype to the build's")
        # An engine built for rows with deepstack additions takes rows without them widened with zeros.
        inputs_embeds = widen_embeds(inputs_embeds, self.runner.limits.ranges["inputs_embeds"][0][2])
        given = {"inputs_embeds": inputs_embeds, "position_ids": position_ids, "block_tables": block_tables,
                 "context_lens": context_lens}
        for name, tensor in (given | {"k_pool": k_pool, "v_pool": v_pool}).items():
            self.runner.limits.check(name, tuple(tensor.shape), _DECODER_FIELDS[name])
        graph = self._graph(inputs_embeds.shape, block_tables.shape[1], k_pool, v_pool)
        if graph is None:
            return self._eager(given, k_pool, v_pool)
        graph.load(given)
        return graph.replay(inputs_embeds.shape[0])

    def _graph(self, embeds_shape, width: int, k_pool, v_pool) -> _TrtGraph | None:
        if self.graphs is None or not k_pool.is_cuda:
            return None
        bucket = self.graphs.plan.bucket(embeds_shape[0], embeds_shape[1], width)
        return None if bucket is None else self.graphs.graph_for(bucket, k_pool, v_pool)

    def _eager(self, given: Mapping[str, torch.Tensor], k_pool, v_pool):
        device, dtypes = k_pool.device, self.runner.dtypes
        # Index inputs take the engine's integer type (int64 as exported, unless TensorRT chose otherwise).
        feeds = {name: t.to(device, dtypes[name], non_blocking=True).contiguous() for name, t in given.items()}
        out = self.runner.run(feeds | {"k_pool": k_pool, "v_pool": v_pool}, device)
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
    manifest: Manifest

    @property
    def precision(self) -> str:
        """The decoder plan's build precision (the profile's ``build.precision``)."""
        return self.manifest.tensorrt.engines["decoder"].precision

    @property
    def build_identity(self) -> str:
        """What the K/V depends on beyond the checkpoint (precision, plan): the prefix cache keys on it."""
        return json.dumps(dict(self.manifest.tensorrt.engines["decoder"].document), sort_keys=True, default=str)


def engine_pool_blocks(config, decoder_cfg) -> int:
    """The device KV blocks the engine allocates for ``config`` (an engine input dim of the plan)."""
    per_block = block_bytes(decoder_cfg.kv_layers, config.block_size, decoder_cfg.kv_size,
                            config.torch_dtype.itemsize)
    return pool_blocks(config.kv_budget_mb, per_block, config.num_blocks)


def this_machine(pool: int | None) -> TensorRTTarget:
    """What a plan must have been built for to run here: this TensorRT, GPU 0, a pool of ``pool`` blocks."""
    trt = import_tensorrt()
    props = torch.cuda.get_device_properties(0)
    return TensorRTTarget(trt.__version__, props.name, f"{props.major}.{props.minor}", pool)


def expected_build(model, profile, config) -> Expected:
    """What the folder must hold for ``model`` to run on TensorRT here with ``profile``."""
    from edgeinfer.backends.onnx.build import GRAPH_FORMAT
    from edgeinfer.profiles import profile_fingerprint

    model_dir = Path(model.adapter.checkpoint.path).resolve()
    return Expected(profile.name, profile_fingerprint(profile), checkpoint_fingerprint(model_dir),
                    graphs=GRAPH_FORMAT, tensorrt=this_machine(engine_pool_blocks(config, model.decoder.cfg)))


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
    fix = build_command("tensorrt", model_dir, profile.name)
    manifest = read_manifest(folder)
    if manifest is None:
        raise EngineBuildError("no TensorRT engines built for this model and profile", artifact=str(folder), fix=fix)
    reasons = stale_reasons(manifest, expected_build(model, profile, config))
    if reasons:
        raise EngineBuildError("stale TensorRT engines: " + "; ".join(reasons), artifact=str(folder), fix=fix)
    runtime = trt.Runtime(trt_logger())
    engines = manifest.tensorrt.engines
    device = torch.device(config.device if ":" in config.device else "cuda:0")
    decoder = model.decoder
    table = decoder.embed_table
    table = table.detach().to(device, config.torch_dtype)
    graph = vision_graph_for(model)
    trt_vision = "vision" in engines and graph is not None
    # The torch weights the plans replace go before the plans are read: on an 8 GB board both
    # at once may not fit.
    from edgeinfer.backends.onnx.runtime import release_replaced_weights

    release_replaced_weights(model, vision=trt_vision)
    decoder_runner = _runner(runtime, folder / DECODER_PLAN, engines["decoder"])
    graphs = DecodeGraphPlan.for_engine(decoder_runner.limits, config.cuda_graphs)
    decoder_engine = TrtDecoderEngine(decoder_runner, table, graphs)
    if trt_vision:
        vision = TrtVisionEngine(_runner(runtime, folder / VISION_PLAN, engines["vision"]), graph, device,
                                 config.unified_memory, config.torch_dtype)
    else:
        from edgeinfer.backends.torch.eager import TorchVisionEngine

        vision = TorchVisionEngine(model.vision)
    if announce:
        print(f"tensorrt {trt.__version__}: {folder}", file=sys.stderr)
    return TrtEngines(decoder_engine, vision, folder, manifest)


def _runner(runtime, path: Path, entry: PlanEntry) -> TrtRunner:
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise EngineBuildError("TensorRT cannot deserialize the engine (its log above says why)", artifact=str(path))
    return TrtRunner(engine, ShapeLimits.from_manifest(entry), path)
