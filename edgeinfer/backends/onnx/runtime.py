"""The ONNX Runtime backend: the engines of ``edgeinfer.backends.onnx.export`` in ORT sessions.

The decoder runs through an IOBinding on every step: the KV pools, the step's inputs and
its output buffers are bound by pointer to the torch tensors that hold them, so a step
copies nothing, least of all the pool (the engine writes the new K/V into it in place and
the next step's binding sees them). Token embedding is a lookup on the host, from the
checkpoint's own table.

Execution providers follow the profile's device and what this ORT build offers:
``cuda`` takes TensorRT's provider where present, else CUDA's; ``cpu`` takes the CPU
provider. Providers can also be named, best first, in ``$EDGEINFER_ORT_PROVIDERS``. Asking
for a provider this ORT does not have is an error, never a fallback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgeinfer.artifacts import (
    Expected,
    Manifest,
    checkpoint_fingerprint,
    engine_dir,
    read_manifest,
    rebuild_command,
    stale_reasons,
)
from edgeinfer.backends.onnx.build import GRAPH_FORMAT, BuildSpec, build_command
from edgeinfer.backends.onnx.graphs import (DECODER_INPUTS, DECODER_OUTPUTS, IMAGE_GROUPS, VISION_OUTPUT, VisionGraph,
                                            vision_graph_for)
from edgeinfer.errors import BackendUnavailableError, EngineBuildError
from edgeinfer.models.decoder import widen_embeds

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
# What each runtime device asks for, best first; CPU is added behind a GPU provider for the
# few ops it leaves to the host.
PREFERRED = {"cpu": (CPU,), "cuda": (TENSORRT, CUDA)}

PROVIDERS_ENV = "EDGEINFER_ORT_PROVIDERS"  # comma-separated provider names, best first

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}


def available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


def select_providers(device: str, requested: Sequence[str] | None = None,
                     available: Sequence[str] | None = None) -> list[str]:
    """The providers to run with. ``requested`` (names, best first) must all be available;
    otherwise the best available provider for ``device``, which must exist."""
    available = list(available_providers() if available is None else available)
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise BackendUnavailableError(f"onnxruntime execution provider {', '.join(missing)} is not available "
                                          f"here (available: {', '.join(available)})")
        return list(requested) if CPU in requested else [*requested, CPU]
    wanted = PREFERRED.get(device)
    if wanted is None:
        raise BackendUnavailableError(f"no onnxruntime provider is known for device {device!r}")
    best = next((p for p in wanted if p in available), None)
    if best is None:
        hint = "pip install onnxruntime-gpu" if device == "cuda" else "pip install onnxruntime"
        raise BackendUnavailableError(f"device {device!r} needs one of {', '.join(wanted)}, and this onnxruntime "
                                      f"offers only {', '.join(available)} ({hint})")
    return [best] if best == CPU else [best, CPU]


def make_session(path: Path, providers: Sequence[str], threads: int | None = None, spin: bool = True):
    """An ORT session of ``path``. ``spin=False`` lets ORT's worker threads sleep as soon as
    they run out of work, instead of spinning for more (see :func:`open_engines`)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), options, providers=list(providers))
    except Exception as exc:  # ORT raises its own pybind types for a bad or truncated file
        raise EngineBuildError(f"onnxruntime cannot load the graph: {exc}", artifact=str(path)) from exc


def _device_of(tensor: torch.Tensor) -> tuple[str, int]:
    return ("cuda", tensor.device.index or 0) if tensor.device.type == "cuda" else ("cpu", 0)


def _bind(binding, name: str, tensor: torch.Tensor, output: bool = False) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous to be bound by pointer")
    kind, index = _device_of(tensor)
    bind = binding.bind_output if output else binding.bind_input
    bind(name, kind, index, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())


class OrtDecoderEngine:
    """Decoder engine contract over an ORT session; every tensor bound by pointer."""

    def __init__(self, session, embed_tokens: Callable[[torch.Tensor], torch.Tensor], num_layers: int,
                 vocab_size: int) -> None:
        """``embed_tokens``: token ids -> embedding rows, the decoder's own lookup on the host
        (Gemma's scaling, Gemma 4's token ids in the rows)."""
        self.session = session
        self.embed_tokens = embed_tokens
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        names = tuple(i.name for i in session.get_inputs())
        if names not in (DECODER_INPUTS, DECODER_INPUTS + (IMAGE_GROUPS,)):
            raise EngineBuildError(f"decoder graph inputs are {list(names)}, expected {list(DECODER_INPUTS)} "
                                   f"(+ {IMAGE_GROUPS!r} for families whose images attend both ways)")
        self.image_groups = names[-1] == IMAGE_GROUPS
        # Rows wider than the embedding table's carry deepstack additions; rows without are widened with zeros.
        self.embeds_width = int(session.get_inputs()[0].shape[-1])

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        b, t = inputs_embeds.shape[:2]
        device, dtype = k_pool.device, k_pool.dtype
        inputs_embeds = widen_embeds(inputs_embeds, self.embeds_width)
        inputs = (inputs_embeds.to(dtype).contiguous(), position_ids.to(torch.int64).contiguous(), k_pool, v_pool,
                  block_tables.to(device, torch.int64).contiguous(), context_lens.to(device, torch.int64).contiguous())
        kv_shape = (self.num_layers, b, t, *k_pool.shape[3:])
        outputs = (torch.empty(b, self.vocab_size, dtype=dtype, device=device),
                   torch.empty(kv_shape, dtype=dtype, device=device), torch.empty(kv_shape, dtype=dtype, device=device))
        binding = self.session.io_binding()
        for name, tensor in zip(DECODER_INPUTS, inputs):
            _bind(binding, name, tensor)
        if self.image_groups:  # every step feeds it; text-only chunks and decode steps are all -1
            groups = torch.full((b, t), -1, dtype=torch.int64) if image_groups is None else image_groups
            _bind(binding, IMAGE_GROUPS, groups.to(device, torch.int64).contiguous())
        for name, tensor in zip(DECODER_OUTPUTS, outputs):
            _bind(binding, name, tensor, output=True)
        self.session.run_with_iobinding(binding)
        return outputs


class OrtVisionEngine:
    """Vision engine contract: host steps of the family's graph around an ORT session.

    Tiles and crops run one at a time: the attention of a whole image's tiles at once would
    hold several times the activations for no gain in speed on a CPU.
    """

    def __init__(self, session, graph: VisionGraph) -> None:
        self.session = session
        self.graph = graph
        self.inputs = [i.name for i in session.get_inputs()]

    @torch.inference_mode()
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        feeds = self.graph.feeds(tensors)
        arrays = {name: feeds[name].cpu().numpy() for name in self.inputs}
        if self.graph.independent_rows:
            rows = len(next(iter(arrays.values())))
            parts = [self._run({k: v[i:i + 1] for k, v in arrays.items()}) for i in range(rows)]
            output = np.concatenate(parts)
        else:
            output = self._run(arrays)
        return self.graph.finish(torch.from_numpy(output), tensors)

    def _run(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run([VISION_OUTPUT], arrays)[0]


@dataclass(frozen=True, slots=True)
class OrtEngines:
    decoder: OrtDecoderEngine
    vision: object  # OrtVisionEngine, or the torch vision engine where the manifest says so
    providers: tuple[str, ...]
    folder: Path
    manifest: Manifest

    @property
    def precision(self) -> str:
        return self.manifest.precision or "fp32"

    @property
    def build_identity(self) -> str:
        """What the K/V depends on beyond the checkpoint: an int8 build's K/V is not an fp32 build's,
        nor are the image embeddings (and so the K/V) of an int8 vision graph an fp32 one's."""
        identity = {"precision": self.manifest.precision, "decoder": dict(self.manifest.engine("decoder").document)}
        vision = self.manifest.engines.get("vision")
        if vision is not None and vision.precision not in (None, "fp32"):
            identity["vision"] = dict(vision.document)
        return json.dumps(identity, sort_keys=True)

    @property
    def vision_on_ort(self) -> bool:
        return isinstance(self.vision, OrtVisionEngine)


def open_engines(model, config, root: str | Path | None = None,
                 providers: Sequence[str] | None = None, announce: bool = True) -> OrtEngines:
    """The ORT engines built for ``model`` under profile ``config.profile_name``, at whichever
    precision they were built.

    The build must be whole and of this checkpoint (any profile check is the caller's, who
    knows the profile); a missing, corrupt or foreign build is an :class:`EngineBuildError`
    naming the folder and the build command.
    """
    folder = engine_dir(root, model.name, config.profile_name)
    model_dir = Path(model.adapter.checkpoint.path).resolve()
    manifest = read_manifest(folder)
    if manifest is None:
        raise EngineBuildError("no onnxruntime engines built for this model and profile", artifact=str(folder),
                               fix=build_command(model_dir, BuildSpec.custom(config.profile_name)))
    # The build as it was made (its own profile and precision), for this checkpoint and this edgeinfer.
    as_built = Expected(manifest.profile, manifest.fingerprint.profile, checkpoint_fingerprint(model_dir),
                        graphs=GRAPH_FORMAT)
    reasons = stale_reasons(manifest, as_built)
    if reasons:
        raise EngineBuildError("stale onnxruntime engines: " + "; ".join(reasons), artifact=str(folder),
                               fix=rebuild_command(manifest) + " --force")
    if config.torch_dtype != torch.float32:
        raise EngineBuildError(f"the onnxruntime engines run float32 KV pools, the engine is configured for "
                               f"{config.dtype}", fix="--set runtime.dtype=float32")
    requested = providers or [p.strip() for p in os.environ.get(PROVIDERS_ENV, "").split(",") if p.strip()]
    chosen = select_providers(config.device, requested)
    if announce:
        print(f"onnxruntime: {folder} ({manifest.precision}) on {', '.join(chosen)}", file=sys.stderr)
    decoder = model.decoder
    # A decode step is short and the engine's host work (torch: the K/V write, the next token)
    # runs between two steps: ORT threads spinning after a step take the cores from it and
    # from torch's own threads. Not spinning costs little in a step and, on a 2-core CPU,
    # cut the time per decoded token by about a quarter (docs/benchmarks.md). The vision
    # engine runs long graphs back to back and keeps spinning.
    session = make_session(folder / manifest.engine("decoder").file, chosen, config.threads, spin=False)
    decoder_engine = OrtDecoderEngine(session, decoder.embed_tokens, decoder.cfg.kv_layers, decoder.cfg.vocab_size)
    return OrtEngines(decoder_engine, _vision_engine(model, folder, manifest, chosen, config.threads),
                      tuple(chosen), folder, manifest)


def _vision_engine(model, folder: Path, manifest: Manifest, providers: Sequence[str], threads: int | None):
    entry = manifest.engine("vision")
    graph = vision_graph_for(model)
    if entry.runtime != "onnxruntime" or entry.file is None or graph is None:
        from edgeinfer.backends.torch.eager import TorchVisionEngine

        return TorchVisionEngine(model.vision)
    return OrtVisionEngine(make_session(folder / entry.file, providers, threads), graph)


def release_replaced_weights(model, vision: bool) -> None:
    """Free the torch weights a built engine replaces (the decoder's, and the vision tower's
    where ``vision``), keeping what the host still runs: the embedding table, and the vision
    encoder's own direct parameters (LLaVA-NeXT's row newline). For loaders that own the
    model they loaded; the modules stay in place on the meta device, so configs and
    attributes still read."""
    decoder = model.decoder
    for child in decoder.children():  # the layers, the final norm (Gemma 4: the per-layer inputs' norm)
        child.to("meta")
    # The embedding table stays: the tied head, or the separate table of an untied one. The rest
    # (an untied head, Gemma 4's per-layer input table and projection) is in the graph.
    kept = "lm_head_t" if decoder.embed is None else "embed"
    for name, param in list(decoder.named_parameters(recurse=False)):
        if name != kept:
            setattr(decoder, name, torch.nn.Parameter(param.to("meta"), requires_grad=False))
    if vision:
        for child in model.vision.children():
            child.to("meta")
