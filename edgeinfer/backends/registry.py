"""The only place that chooses a backend, and opens its engines as an :class:`Engines` bundle.

``auto`` (the default of ``edgeinfer run``, ``edgeinfer serve`` and ``Engine.load``) runs the
fastest engines that are built and fresh for this model and profile, and builds nothing:

- on a CPU, the profile's ONNX Runtime build at the precision it was built with (int4, int8
  or fp32; one folder holds one build), else torch;
- on CUDA, the profile's TensorRT build, else torch (with CUDA graphs where the profile
  turns them on).

A build that exists but is stale (another profile, checkpoint, GPU or TensorRT; a file
changed) is not used and not replaced: it is named, with the command that rebuilds it, on
stderr and in ``Engines.passed_over``.

A named backend must be installed: there is no silent fallback. ``onnxruntime`` runs the
profile's build at whichever precision it was built, and builds only when no usable build
exists (missing or stale; a stale int8 or int4 build is rebuilt as it was quantized, never as fp32).
``tensorrt`` never builds: missing or stale plans are an error naming the build command.

The model handed to :func:`open_engines` becomes the engines': ``Engine.load`` loads it for
the engine alone. ONNX Runtime and TensorRT free the torch weights their graphs replace;
CUDA graphs re-lay out the decoder's matrices for the kernels that read them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shlex
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from edgeinfer.artifacts import (
    MANIFEST,
    Manifest,
    ManifestError,
    build_command,
    checkpoint_fingerprint,
    engine_dir,
    read_manifest,
    stale_reasons,
)
from edgeinfer.backends.base import Engines, RunSettings
from edgeinfer.errors import BackendUnavailableError, EngineBuildError, ProfileError


class Backend(str, Enum):
    AUTO = "auto"
    TORCH = "torch"
    ONNXRUNTIME = "onnxruntime"
    TENSORRT = "tensorrt"


# backend -> (module that must import, how to install it)
REQUIREMENTS: dict[Backend, tuple[str, str]] = {
    Backend.TORCH: ("torch", "pip install torch"),
    Backend.ONNXRUNTIME: ("onnxruntime", "pip install onnxruntime (or onnxruntime-gpu on CUDA)"),
    Backend.TENSORRT: ("tensorrt", "install TensorRT 10.x (JetPack ships it on Jetson: sudo apt install "
                                   "python3-libnvinfer; pip install 'edgeinfer[tensorrt]' elsewhere)"),
}
# The torch backend's precision is its runtime dtype, named as builds name theirs.
TORCH_PRECISION = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def backend_named(name: str | Backend) -> Backend:
    """The backend called ``name``; an unknown name is an error listing the valid ones."""
    try:
        return Backend(name)
    except ValueError:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of: "
                                      f"{', '.join(b.value for b in Backend)}") from None


def installed(backend: Backend) -> bool:
    return importlib.util.find_spec(REQUIREMENTS[backend][0]) is not None


def require_backend(name: str | Backend) -> Backend:
    """``name`` as a Backend; a named backend whose package is missing is an error saying what to install."""
    backend = backend_named(name)
    if backend is not Backend.AUTO and not installed(backend):
        module, how = REQUIREMENTS[backend]
        raise BackendUnavailableError(f"backend {backend.value!r} needs the {module!r} package, which is not "
                                      f"installed: {how}")
    return backend


# --------------------------------------------------------------------------- what is built


@dataclass(frozen=True, slots=True)
class Built:
    """The build one backend would run for this model and profile, as the engines folder holds it."""

    backend: Backend
    folder: Path
    manifest: Manifest | None  # None: not built, or a manifest that cannot be read
    reasons: tuple[str, ...]  # why it cannot run as it is; () when it can
    rebuild: str

    @property
    def fresh(self) -> bool:
        return self.manifest is not None and not self.reasons

    @property
    def exists(self) -> bool:
        return (self.folder / MANIFEST).is_file()

    def note(self) -> str:
        """One line naming the stale build, why, and the command that rebuilds it."""
        return (f"{self.folder}: stale {self.backend.value} engines, not used ({'; '.join(self.reasons)}); "
                f"rebuild: {self.rebuild}")


def rebuild_for(backend: Backend, model, profile, config: RunSettings, precision: str | None = None) -> str:
    """The ``edgeinfer build`` command whose build fits ``profile`` as it is now: the shipped
    profile of its name, with a ``--set`` for each setting a build depends on that differs."""
    name = profile.name if profile is not None else config.profile_name
    command = build_command(backend.value, _model_dir(model), name, precision)
    sets = _overrides(profile, tensorrt=backend is Backend.TENSORRT) if profile is not None else []
    return " ".join([command, *(f"--set {shlex.quote(s)}" for s in sets)])


def _overrides(profile, *, tensorrt: bool) -> list[str]:
    from edgeinfer.profiles import engine_settings, load_profile

    try:
        shipped = load_profile(profile.name)
    except ProfileError:
        return []  # a profile of its own file: its name alone says nothing
    now, base = engine_settings(profile), engine_settings(shipped)
    pairs = [(f"{section}.{key}", value) for section in ("build", "runtime", "kv")
             for key, value in now[section].items() if base[section].get(key) != value]
    if tensorrt:  # the plans also fix the pool's length
        pairs += [(name, value) for name, value, was in (
            ("memory.kv_device_budget_mb", profile.memory.kv_device_budget_mb, shipped.memory.kv_device_budget_mb),
            ("kv.device_blocks", profile.kv.device_blocks, shipped.kv.device_blocks)) if value != was]
    return [f"{name}={json.dumps(value)}" for name, value in pairs]


def _onnx_spec(profile, config: RunSettings):
    from edgeinfer.backends.onnx.build import BuildSpec

    return BuildSpec.from_profile(profile) if profile is not None else \
        BuildSpec.custom(config.profile_name, config.block_size)


def _model_dir(model) -> Path:
    return Path(model.adapter.checkpoint.path).resolve()


def onnxruntime_build(model, profile, config: RunSettings, root: str | Path | None = None) -> Built:
    """The profile's ONNX Runtime build; fresh at any precision it was built with."""
    spec = _onnx_spec(profile, config)
    folder = engine_dir(root, model.name, spec.profile)
    manifest = _read(Backend.ONNXRUNTIME, folder, rebuild_for(Backend.ONNXRUNTIME, model, profile, config))
    if isinstance(manifest, Built):
        return manifest
    expected = spec.expected(checkpoint_fingerprint(_model_dir(model)), any_precision=True)
    # A quantized build is rebuilt at its precision (see onnxruntime_engines).
    rebuild = rebuild_for(Backend.ONNXRUNTIME, model, profile, config, manifest.precision)
    return Built(Backend.ONNXRUNTIME, folder, manifest, tuple(stale_reasons(manifest, expected)), rebuild)


def tensorrt_build(model, profile, config: RunSettings, root: str | Path | None = None) -> Built:
    """The profile's TensorRT build, compared with this machine (needs TensorRT and a GPU)."""
    from edgeinfer.backends.tensorrt.runtime import expected_build

    folder = engine_dir(root, model.name, profile.name)
    command = rebuild_for(Backend.TENSORRT, model, profile, config)
    manifest = _read(Backend.TENSORRT, folder, command)
    if isinstance(manifest, Built):
        return manifest
    reasons = stale_reasons(manifest, expected_build(model, profile, config))
    return Built(Backend.TENSORRT, folder, manifest, tuple(reasons), command)


def _read(backend: Backend, folder: Path, command: str) -> Manifest | Built:
    """The folder's manifest, or the unusable build that says why there is none."""
    try:
        manifest = read_manifest(folder)
    except ManifestError as exc:
        return Built(backend, folder, None, (str(exc),), command)
    return manifest if manifest is not None else Built(backend, folder, None, ("not built",), command)


# --------------------------------------------------------------------------- the choice


@dataclass(frozen=True, slots=True)
class Choice:
    backend: Backend
    build: Built | None  # the build to run or to (re)build; None for torch
    passed_over: tuple[str, ...] = ()


def choose(requested: str | Backend, model, profile, config: RunSettings, root: str | Path | None = None) -> Choice:
    """Which backend runs ``model`` with ``profile`` (None: an engine configured without one)."""
    backend = require_backend(requested)
    if backend is Backend.AUTO:
        return _auto(model, profile, config, root)
    if backend is Backend.ONNXRUNTIME:
        return Choice(backend, onnxruntime_build(model, profile, config, root))
    return Choice(backend, None)


def _auto(model, profile, config: RunSettings, root: str | Path | None) -> Choice:
    candidate = None
    try:
        if config.device.startswith("cuda"):
            candidate = _tensorrt_candidate(model, profile, config, root)
        elif config.device == "cpu" and config.dtype == "float32" and installed(Backend.ONNXRUNTIME):
            candidate = onnxruntime_build(model, profile, config, root)
    except (BackendUnavailableError, EngineBuildError):
        # A profile the onnxruntime backend does not build for (its precision), or a TensorRT
        # that does not import: nothing here could be built for it, so nothing is passed over.
        candidate = None
    if candidate is not None and candidate.fresh:
        return Choice(candidate.backend, candidate)
    stale = (candidate.note(),) if candidate is not None and candidate.exists else ()
    return Choice(Backend.TORCH, None, stale)


def _tensorrt_candidate(model, profile, config: RunSettings, root: str | Path | None) -> Built | None:
    import torch

    if profile is None or not installed(Backend.TENSORRT) or not torch.cuda.is_available():
        return None
    built = tensorrt_build(model, profile, config, root)
    # A folder with graphs but no plans holds no TensorRT build to pass over.
    return None if built.manifest is not None and built.manifest.tensorrt is None else built


# --------------------------------------------------------------------------- opening


def open_engines(requested: str | Backend, model, profile, config: RunSettings,
                 root: str | Path | None = None) -> Engines:
    """Choose the backend and open its engines over ``model``, which they take over (see the
    module's docstring)."""
    choice = choose(requested, model, profile, config, root)
    for line in choice.passed_over:
        print(f"warning: {line}", file=sys.stderr)
    if choice.backend is Backend.ONNXRUNTIME:
        engines = onnxruntime_engines(model, profile, config, root, choice.build)
    elif choice.backend is Backend.TENSORRT:
        engines = tensorrt_engines(model, profile, config, root)
    else:
        engines = torch_engines(model, config)
    return dataclasses.replace(engines, passed_over=choice.passed_over)


def torch_engines(model, config: RunSettings) -> Engines:
    """The torch engines: CUDA-graph decode steps where the profile asks for them on a GPU."""
    from edgeinfer.backends.torch.eager import TorchDecoderEngine, TorchVisionEngine

    vision = TorchVisionEngine(model.vision)
    precision = TORCH_PRECISION[config.dtype]
    if config.cuda_graphs and config.device.startswith("cuda"):
        from edgeinfer.backends.torch.cuda_graphs import CudaGraphDecoderEngine

        max_blocks = -(-config.max_context // config.block_size)
        decoder = CudaGraphDecoderEngine(model.decoder, config.max_batch_size, max_blocks, fused=config.fused_decode,
                                         prefill_graphs=config.prefill_graphs, take_decoder=True,
                                         step_tuning_s=config.step_tuning_s)
        return Engines(decoder, vision, Backend.TORCH.value, precision, bursts=decoder, compiler=vision,
                       graphs=decoder)
    return Engines(TorchDecoderEngine(model.decoder), vision, Backend.TORCH.value, precision, compiler=vision)


def onnxruntime_engines(model, profile, config: RunSettings, root: str | Path | None = None,
                        built: Built | None = None) -> Engines:
    """The ONNX Runtime engines of the profile's build, building it first where none is usable."""
    from edgeinfer.backends.onnx.build import build_engines
    from edgeinfer.backends.onnx.runtime import open_engines as open_ort
    from edgeinfer.backends.onnx.runtime import release_replaced_weights
    from edgeinfer.backends.torch.eager import TorchVisionEngine

    built = built or onnxruntime_build(model, profile, config, root)
    if not built.fresh:
        spec = _onnx_spec(profile, config)
        # A quantized build stays quantized as it was asked for once, by the profile or a flag.
        spec = spec.like_build(built.manifest)
        result = build_engines(model, spec, root)  # with a progress bar
        if not result.skipped and result.reasons:
            print(f"built {result.folder}, because " + "; ".join(result.reasons), file=sys.stderr)
    opened = open_ort(model, config, root)
    release_replaced_weights(model, vision=opened.vision_on_ort)
    compiler = opened.vision if isinstance(opened.vision, TorchVisionEngine) else None
    return Engines(opened.decoder, opened.vision, Backend.ONNXRUNTIME.value, opened.precision,
                   compiler=compiler, build_identity=opened.build_identity)


def tensorrt_engines(model, profile, config: RunSettings, root: str | Path | None = None) -> Engines:
    """The TensorRT engines of the profile's build; refused when missing or stale."""
    from edgeinfer.backends.tensorrt.runtime import open_engines as open_trt
    from edgeinfer.backends.torch.eager import TorchVisionEngine

    opened = open_trt(model, profile, config, root)
    compiler = opened.vision if isinstance(opened.vision, TorchVisionEngine) else None
    return Engines(opened.decoder, opened.vision, Backend.TENSORRT.value, opened.precision,
                   compiler=compiler, build_identity=opened.build_identity)
