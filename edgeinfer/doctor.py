"""Checks behind ``edgeinfer doctor``: each returns pass / warn / fail and the fix.

The software stack is read once into an :class:`Environment` (the boundary a test may
replace); the machine is read under ``root`` like :mod:`edgeinfer.device`.

Built engines (``<engines>/<model>/<profile>/manifest.json``) go through the one staleness
check of :mod:`edgeinfer.artifacts`, the check a load makes: against the profile of their
name as it reads now, the checkpoint they were built from where its folder is still there,
this edgeinfer's graph format, and, for a TensorRT build, this machine's TensorRT and GPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgeinfer.artifacts import (
    CHECKPOINT_CONFIG,
    Expected,
    ManifestError,
    TensorRTTarget,
    checkpoint_fingerprint,
    manifest_paths,
    read_manifest,
    rebuild_command,
    stale_reasons,
)
from edgeinfer.device import DeviceInfo, detect_device, jetpack_for_l4t, read_swaps, tensorrt_matches_jetpack
from edgeinfer.errors import EdgeInferError, ProfileError
from edgeinfer.power import read_clocks, read_power_mode
from edgeinfer.profiles import DeviceProfile, choose_profile, load_profile, profile_fingerprint
from edgeinfer.tile_cache import TILE_CACHE_ENV, default_folder

Status = Literal["pass", "warn", "fail"]

MIN_PYTHON = (3, 10)
MIN_TRANSFORMERS = 5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
SETUP_HINT = "bash jetson/setup.sh (JetPack's own torch in a venv)"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str | None = None


def _pass(name: str, detail: str) -> Check:
    return Check(name, "pass", detail)


def _warn(name: str, detail: str, fix: str | None = None) -> Check:
    return Check(name, "warn", detail, fix)


def _fail(name: str, detail: str, fix: str | None = None) -> Check:
    return Check(name, "fail", detail, fix)


# --------------------------------------------------------------------------- environment


@dataclass(frozen=True, slots=True)
class Environment:
    """Versions of the software stack; None where a package is absent."""

    python: tuple[int, int, int]
    torch: str | None
    torch_cuda: str | None
    cuda_available: bool
    cuda_device: str | None
    transformers: str | None
    tensorrt: str | None
    onnxruntime: str | None
    ort_providers: tuple[str, ...] = field(default_factory=tuple)
    triton: str | None = None
    triton_cannot_build: str | None = None  # why Triton cannot build kernels for GPU 0 (None: it can, or no GPU)


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _module_version(name: str) -> str | None:
    try:
        return getattr(importlib.import_module(name), "__version__", "unknown")
    except ImportError:
        return None


def _probe_torch() -> tuple[str | None, str | None, bool, str | None]:
    try:
        import torch
    except ImportError:
        return None, None, False, None
    available = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if available else None
    return torch.__version__, torch.version.cuda, available, name


def _probe_ort() -> tuple[str | None, tuple[str, ...]]:
    try:
        import onnxruntime
    except ImportError:
        return None, ()
    return onnxruntime.__version__, tuple(onnxruntime.get_available_providers())


def _probe_triton_build(cuda_available: bool) -> str | None:
    """Why Triton cannot build kernels for GPU 0 (:func:`edgeinfer.quant.kernels.cannot_build`)."""
    if not cuda_available:
        return None
    import torch

    from edgeinfer.quant.kernels import cannot_build

    return cannot_build(torch.device("cuda", 0))


def probe_environment() -> Environment:
    torch_version, torch_cuda, available, device = _probe_torch()
    ort_version, providers = _probe_ort()
    # Jetson installs TensorRT's Python bindings from apt, without package metadata.
    tensorrt = _distribution_version("tensorrt", "tensorrt-cu12", "tensorrt-cu13") or _module_version("tensorrt")
    return Environment(
        python=tuple(sys.version_info[:3]), torch=torch_version, torch_cuda=torch_cuda,
        cuda_available=available, cuda_device=device, transformers=_distribution_version("transformers"),
        tensorrt=tensorrt, onnxruntime=ort_version, ort_providers=providers,
        triton=_distribution_version("triton", "pytorch-triton") or _module_version("triton"),
        triton_cannot_build=_probe_triton_build(available))


def _major(version: str) -> int:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else 0


# --------------------------------------------------------------------------- software


def check_python(env: Environment) -> Check:
    version = ".".join(map(str, env.python))
    if env.python[:2] < MIN_PYTHON:
        return _fail("python", f"{version} ({platform.python_implementation()})",
                     f"use Python >= {'.'.join(map(str, MIN_PYTHON))}")
    return _pass("python", version)


def check_torch(env: Environment, device: DeviceInfo) -> Check:
    if env.torch is None:
        fix = SETUP_HINT if device.kind == "jetson" else "pip install torch"
        return _fail("torch", "not installed", fix)
    return _pass("torch", f"{env.torch} (CUDA {env.torch_cuda})" if env.torch_cuda else f"{env.torch} (CPU build)")


def check_transformers(env: Environment) -> Check:
    fix = "pip install 'transformers>=5,<6'"
    if env.transformers is None:
        return _fail("transformers", "not installed", fix)
    if _major(env.transformers) < MIN_TRANSFORMERS:
        return _fail("transformers", f"{env.transformers} is older than {MIN_TRANSFORMERS}.0", fix)
    return _pass("transformers", env.transformers)


def check_cuda(env: Environment, device: DeviceInfo, profile: DeviceProfile | None) -> Check:
    wants_cuda = profile is not None and profile.runtime.device == "cuda"
    if env.cuda_available:
        return _pass("cuda", f"{env.cuda_device} (sm {device.sm or '?'})")
    if device.kind == "cpu" and not wants_cuda:
        return _pass("cuda", "no CUDA device; running on CPU")
    fix = SETUP_HINT if device.kind == "jetson" else "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu128)"
    gpu = device.model or "a GPU"
    if device.kind == "cpu":
        return _fail("cuda", f"profile {profile.name!r} runs on cuda but this machine has no CUDA device",
                     "edgeinfer ... --profile cpu")
    return _fail("cuda", f"{gpu} is present but torch cannot use CUDA", fix)


def check_tensorrt(env: Environment, device: DeviceInfo) -> Check:
    if env.tensorrt is not None:
        return _pass("tensorrt", env.tensorrt)
    if device.kind == "cpu":
        return _pass("tensorrt", "not installed (not used on CPU)")
    fix = "sudo apt install python3-libnvinfer" if device.kind == "jetson" else "pip install 'edgeinfer[tensorrt]'"
    return _warn("tensorrt", "not installed; engines run on ONNX Runtime or PyTorch", fix)


def check_triton(env: Environment, device: DeviceInfo) -> Check:
    """Triton runs the fused batch-1 decode kernels and torch.compile's GPU code; without it a
    CUDA-graph decode step runs eager layers."""
    if env.triton is not None and env.triton_cannot_build is not None and device.kind != "cpu":
        return _warn("triton", f"{env.triton} cannot build for this GPU ({env.triton_cannot_build}); the fused "
                     "decode and low-bit kernels are off, torch runs those products",
                     "install a Triton whose ptxas knows this GPU (Jetson Thor, sm_110 from CUDA 13: "
                     "Triton 3.9 builds for it, 3.6 does not)")
    if env.triton is not None:
        return _pass("triton", f"{env.triton}; batch-1 decode runs fused kernels")
    if device.kind == "cpu":
        return _pass("triton", "not installed (not used on CPU)")
    if device.kind == "jetson":  # JetPack's PyTorch comes without it, and no wheel is assured
        return _pass("triton", "not installed; CUDA-graph decode steps run eager layers")
    return _warn("triton", "not installed; CUDA-graph decode steps run eager layers", "pip install triton")


def check_tile_cache(folder: Path | None) -> Check:
    """Where the Triton kernels' tile choices are kept across processes (:mod:`edgeinfer.tile_cache`):
    without a writable folder every load times them again."""
    if folder is None:
        return _pass("tile cache", f"off ({TILE_CACHE_ENV}=off): every load times the kernels' tiles")
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return _warn("tile cache", f"{folder} cannot be written: every load times the kernels' tiles",
                     f"set {TILE_CACHE_ENV} to a writable folder")
    files = len(list(folder.glob("*.json"))) if folder.is_dir() else 0
    return _pass("tile cache", f"{folder} ({files} GPU and kernel build{'s' if files != 1 else ''} kept)")


def check_onnxruntime(env: Environment, device: DeviceInfo) -> Check:
    if env.onnxruntime is None:
        return _warn("onnxruntime", "not installed; the onnxruntime backend is unavailable", "pip install onnxruntime")
    providers = ", ".join(env.ort_providers) or "none"
    has_gpu = any(provider in env.ort_providers for provider in GPU_PROVIDERS)
    if device.kind != "cpu" and not has_gpu:
        fix = "install the onnxruntime-gpu wheel for your JetPack" if device.kind == "jetson" else "pip install onnxruntime-gpu"
        return _warn("onnxruntime", f"{env.onnxruntime}; providers: {providers} (no GPU provider)", fix)
    return _pass("onnxruntime", f"{env.onnxruntime}; providers: {providers}")


def check_jetpack(env: Environment, device: DeviceInfo) -> Check:
    release = jetpack_for_l4t(device.l4t_version)
    if release is None:
        return _warn("jetpack", f"L4T {device.l4t_version or 'unknown'} is not a JetPack edgeinfer knows",
                     "flash JetPack 6.x (Orin) or 7.x (Thor)")
    detail = f"JetPack {release.jetpack} (L4T {device.l4t_version}), expects TensorRT {release.tensorrt}"
    if env.tensorrt is None or tensorrt_matches_jetpack(env.tensorrt, release):
        return _pass("jetpack", detail)
    return _fail("jetpack", f"TensorRT {env.tensorrt} does not match {detail}",
                 "uninstall the pip tensorrt wheel and use JetPack's: sudo apt install python3-libnvinfer")


# --------------------------------------------------------------------------- Jetson power


def check_power_mode(root: str | Path) -> Check:
    mode = read_power_mode(root)
    if mode is None:
        return _warn("power mode", "cannot read nvpmodel's status", "sudo nvpmodel -q")
    if mode.is_max:
        return _pass("power mode", f"{mode.name} (mode {mode.id})")
    best = mode.max_mode
    fix = f"sudo nvpmodel -m {best[0]}  # {best[1]}" if best else "sudo nvpmodel -m 0"
    return _warn("power mode", f"{mode.name or mode.id} is not the maximum; benchmarks will read low", fix)


def check_clocks(root: str | Path) -> Check:
    clocks = read_clocks(root)
    if clocks.cpu_locked is None and clocks.gpu_locked is None:
        return _warn("clocks", "cannot read CPU/GPU clock limits", "sudo jetson_clocks --show")
    if clocks.locked:
        return _pass("clocks", f"pinned at maximum (GPU {clocks.gpu_max_mhz} MHz)")
    return _warn("clocks", "not pinned (dynamic scaling); benchmarks will vary", "sudo jetson_clocks")


def check_swap(root: str | Path, device: DeviceInfo) -> Check:
    swaps = read_swaps(root)
    zram = sum(s.size_mb for s in swaps if s.zram)
    disk = sum(s.size_mb for s in swaps if not s.zram)
    detail = f"swap {disk} MiB, zram {zram} MiB"
    small_jetson = device.kind == "jetson" and device.memory_total_mb <= 16384
    if small_jetson and disk == 0:
        return _warn("swap", f"{detail}; engine builds may run out of memory",
                     "add an NVMe swap file: sudo fallocate -l 16G /ssd/swap && sudo mkswap /ssd/swap && sudo swapon /ssd/swap")
    return _pass("swap", detail)


# --------------------------------------------------------------------------- memory and profile


def check_profile(choice_text: str, profile: DeviceProfile | None, error: ProfileError | None) -> Check:
    if error is not None:
        return _fail("profile", str(error), "edgeinfer profiles validate FILE  # or pick one: edgeinfer profiles list")
    return _pass("profile", f"{profile.name} ({choice_text})")


def memory_needed_mb(profile: DeviceProfile) -> int:
    """System memory a profile plans to take: on unified memory the KV pool and the host
    tier come out of the same DRAM; on a discrete GPU only the host tier does."""
    memory = profile.memory
    pool = memory.kv_device_budget_mb if memory.unified else 0
    return memory.available_floor_mb + memory.host_tier_mb + pool


def check_memory(device: DeviceInfo, profile: DeviceProfile | None) -> Check:
    available = device.memory_available_mb
    if profile is None:
        return _pass("memory", f"MemAvailable {available} MiB of {device.memory_total_mb} MiB")
    floor, needed = profile.memory.available_floor_mb, memory_needed_mb(profile)
    detail = f"MemAvailable {available} MiB; profile {profile.name!r} plans for {needed} MiB"
    if available < floor:
        return _fail("memory", f"{detail} (under its floor of {floor} MiB)",
                     "stop other processes, or choose a smaller profile")
    if available < needed:
        return _warn("memory", detail, "free memory, or lower memory.kv_device_budget_mb / "
                     "memory.host_tier_mb with --set")
    return _pass("memory", detail)


def check_gpu_memory(device: DeviceInfo, profile: DeviceProfile) -> Check | None:
    if device.kind != "cuda" or device.cuda_memory_mb is None:
        return None
    want = profile.memory.total_mb
    detail = f"{device.cuda_memory_mb} MiB on the GPU; profile {profile.name!r} assumes {want} MiB"
    if device.cuda_memory_mb < want * 0.9:
        return _warn("gpu memory", detail, f"--set memory.total_mb={device.cuda_memory_mb} and a smaller memory.kv_device_budget_mb")
    return _pass("gpu memory", detail)


# --------------------------------------------------------------------------- model folder


def _supported_architectures() -> list[str] | None:
    try:
        models = importlib.import_module("edgeinfer.models")
    except ImportError:
        return None
    supported = getattr(models, "supported_architectures", None)
    return list(supported()) if callable(supported) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_model_architecture(model_dir: Path,
                             registry: Callable[[], list[str] | None] = _supported_architectures) -> Check:
    config = _read_json(model_dir / "config.json")
    if not isinstance(config, dict):
        return _fail("model config", f"{model_dir}/config.json is missing or not JSON",
                     "point --model at a Hugging Face checkpoint folder")
    architectures = config.get("architectures")
    if not architectures:
        return _fail("model config", "config.json has no 'architectures'",
                     "add \"architectures\": [\"<ModelClass>\"] to config.json")
    supported = registry()
    if supported is None:
        return _warn("model config", f"{architectures}: model registry unavailable, support not checked")
    if not any(name in supported for name in architectures):
        return _fail("model config", f"{architectures} is not supported",
                     f"use a checkpoint of: {', '.join(sorted(supported))}")
    return _pass("model config", ", ".join(architectures))


def check_model_files(model_dir: Path) -> list[Check]:
    checks = []
    for name, files in (("tokenizer", TOKENIZER_FILES), ("processor", PROCESSOR_FILES)):
        found = [f for f in files if (model_dir / f).is_file()]
        checks.append(_pass(name, ", ".join(found)) if found else
                      _fail(name, f"none of {', '.join(files)} in {model_dir}",
                            "download the full checkpoint (hf download REPO --local-dir DIR)"))
    return checks


def _kernels_off(env: Environment) -> str | None:
    """Why the low-bit GPU kernels cannot run on this machine's GPU (None: they can, or no GPU to ask)."""
    if not env.cuda_available:
        return None
    if env.triton is None:
        return "Triton is not installed"
    return None if env.triton_cannot_build is None else f"Triton {env.triton} cannot build for this GPU"


def check_model_weights(model_dir: Path, profile: DeviceProfile | None = None, kernels_off: str | None = None) -> Check:
    """The checkpoint's weight format and bytes, and on a GPU profile what its packed layers leave
    the KV pool, or, where the low-bit kernels cannot run (``kernels_off``: why), that the decoder
    is dequantized at load; an unsupported quantization format fails."""
    try:
        from edgeinfer.quant.footprint import weight_footprint
    except ImportError as exc:
        return _warn("model weights", f"weight format not read: {exc}")
    try:
        footprint = weight_footprint(model_dir)
    except EdgeInferError as exc:
        return _fail("model weights", str(exc), "use a dense checkpoint or one in a supported format")
    detail = footprint.describe()
    if profile is not None and footprint.quantized_layers and profile.runtime.device.startswith("cuda") \
            and kernels_off is not None:
        return _warn("model weights", f"{detail}; on {profile.name} the decoder is dequantized at load "
                     f"({kernels_off}): dense weights, as the profile's plan allows, at the dense model's speed",
                     "install a Triton that builds for this GPU, or build TensorRT / ONNX Runtime engines")
    if profile is not None and footprint.quantized_layers and profile.runtime.device.startswith("cuda"):
        dtype_bytes = 4 if profile.runtime.dtype == "float32" else 2
        saved = footprint.saved_bytes(dtype_bytes) // 2**20
        budget = profile.memory.kv_device_budget_mb
        detail += (f"; on {profile.name} the decoder keeps them packed, so the KV pool gets up to {saved} MiB "
                   f"more than the dense model would leave: {budget} + {saved} = {budget + saved} MiB")
    return _pass("model weights", detail)


# --------------------------------------------------------------------------- engines


def _profile_fingerprint_of(name: str) -> str | None:
    try:
        return profile_fingerprint(load_profile(name))
    except ProfileError:
        return None


def _graph_format():
    """The ONNX graph format this edgeinfer writes; None where the onnx backend does not import."""
    try:
        from edgeinfer.backends.onnx.build import GRAPH_FORMAT
    except ImportError:
        return None
    return GRAPH_FORMAT


def _checkpoint_of(manifest) -> str | None:
    """The fingerprint of the checkpoint a build was made from, where its folder is still there."""
    folder = Path(manifest.model_dir) if manifest.model_dir else None
    return checkpoint_fingerprint(folder) if folder is not None and (folder / CHECKPOINT_CONFIG).is_file() else None


def engine_expectation(manifest, env: Environment, device: DeviceInfo) -> Expected:
    """What a build must match on this machine, as far as doctor knows: the profile of its name,
    its checkpoint, this edgeinfer's graphs and, where TensorRT plans were built, this TensorRT and GPU."""
    machine = TensorRTTarget(env.tensorrt, None, device.sm, required=False)
    return Expected(manifest.profile, _profile_fingerprint_of(manifest.profile), _checkpoint_of(manifest),
                    graphs=_graph_format(), tensorrt=machine)


def check_engines(engines_dir: Path, env: Environment, device: DeviceInfo) -> list[Check]:
    checks = []
    for path in manifest_paths(engines_dir):
        label = f"engine {path.parent.parent.name}/{path.parent.name}"
        try:
            manifest = read_manifest(path.parent)
        except ManifestError as exc:
            checks.append(_fail(label, str(exc), f"rm -r {path.parent}"))
            continue
        reasons = stale_reasons(manifest, engine_expectation(manifest, env, device))
        if not reasons:
            checks.append(_pass(label, "fingerprint matches"))
            continue
        checks.append(_fail(label, "stale: " + "; ".join(reasons), rebuild_command(manifest)))
    return checks


# --------------------------------------------------------------------------- all together


def _load(profile: str | None, overrides: Sequence[str], root: str | Path) -> tuple[str, DeviceProfile | None, ProfileError | None]:
    try:
        choice = choose_profile(profile, root=root)
        return choice.reason, load_profile(choice.selector, overrides, root=root), None
    except ProfileError as error:
        return "", None, error


def run_checks(*, root: str | Path = "/", model_dir: Path | None = None, engines_dir: Path = Path("engines"),
               profile: str | None = None, overrides: Sequence[str] = (),
               env: Environment | None = None, device: DeviceInfo | None = None) -> list[Check]:
    env = env or probe_environment()
    device = device or detect_device(root)
    reason, chosen, error = _load(profile, overrides, root)
    checks = [check_python(env), check_torch(env, device), check_transformers(env),
              check_cuda(env, device, chosen), check_tensorrt(env, device), check_triton(env, device),
              check_onnxruntime(env, device)]
    if env.triton is not None and device.kind != "cpu":
        checks.append(check_tile_cache(default_folder()))
    if device.kind == "jetson":
        checks += [check_jetpack(env, device), check_power_mode(root), check_clocks(root)]
    checks += [check_swap(root, device), check_profile(reason, chosen, error), check_memory(device, chosen)]
    gpu = check_gpu_memory(device, chosen) if chosen else None
    checks += [gpu] if gpu else []
    if model_dir is not None:
        checks += [check_model_architecture(model_dir), *check_model_files(model_dir),
                   check_model_weights(model_dir, chosen, _kernels_off(env))]
    return checks + check_engines(engines_dir, env, device)


def any_failed(checks: Sequence[Check]) -> bool:
    return any(check.status == "fail" for check in checks)
