"""What machine this is: Jetson model and L4T release, discrete GPU, memory, swap.

Facts only; which profile or limit follows from them is decided elsewhere. Every file
is read under ``root`` so a test can point it at a fake ``/proc`` + ``/sys`` + ``/etc``
tree. torch and NVML are asked only when ``root`` is the real ``/``: they describe
this machine, not the tree. On unified memory (Jetson) the GPU allocates from the same
DRAM as everything else, so ``MemAvailable`` — not ``MemFree``, which ignores
reclaimable page cache — is the number that says what can still be allocated.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

DeviceKind = Literal["jetson", "cuda", "cpu"]

_TEGRA_COMPATIBLE = re.compile(r"nvidia,tegra(194|234|264)", re.IGNORECASE)
_RELEASE_LINE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", re.IGNORECASE)


# --------------------------------------------------------------------------- JetPack table


@dataclass(frozen=True, slots=True)
class JetPackRelease:
    """One JetPack: the L4T release it ships and the TensorRT / CUDA it pairs with."""

    l4t: str
    jetpack: str
    tensorrt: str
    cuda: str


# Longest L4T prefix wins; from NVIDIA's JetPack release notes.
JETPACK_RELEASES: tuple[JetPackRelease, ...] = (
    JetPackRelease("35.3", "5.1.1", "8.5", "11.4"),
    JetPackRelease("35.4", "5.1.2", "8.5", "11.4"),
    JetPackRelease("35.5", "5.1.3", "8.5", "11.4"),
    JetPackRelease("35.6", "5.1.4", "8.5", "11.4"),
    JetPackRelease("36.2", "6.0 DP", "8.6", "12.2"),
    JetPackRelease("36.3", "6.0", "8.6", "12.2"),
    JetPackRelease("36.4", "6.1", "10.3", "12.6"),
    JetPackRelease("36.4.3", "6.2", "10.3", "12.6"),
    JetPackRelease("36.4.4", "6.2.1", "10.3", "12.6"),
    JetPackRelease("36.4.7", "6.2.1", "10.3", "12.6"),
    JetPackRelease("38.2", "7.0", "10.13", "13.0"),
)


def _version_parts(version: str) -> list[str]:
    return version.split(".")


def jetpack_for_l4t(l4t: str | None) -> JetPackRelease | None:
    """The JetPack whose L4T release is the longest prefix of ``l4t``."""
    if not l4t:
        return None
    parts = _version_parts(l4t)
    candidates = [r for r in JETPACK_RELEASES if parts[: len(_version_parts(r.l4t))] == _version_parts(r.l4t)]
    return max(candidates, key=lambda r: len(_version_parts(r.l4t)), default=None)


def tensorrt_matches_jetpack(tensorrt_version: str, release: JetPackRelease) -> bool:
    """TensorRT on a Jetson must be the major.minor its JetPack ships."""
    want = _version_parts(release.tensorrt)
    return _version_parts(tensorrt_version)[: len(want)] == want


# --------------------------------------------------------------------------- files under root


def under(root: str | Path, path: str) -> Path:
    return Path(root) / path.lstrip("/")


def read_text(root: str | Path, path: str) -> str | None:
    """A small system file's text without trailing NULs and whitespace; None if unreadable."""
    try:
        return under(root, path).read_text(encoding="utf-8", errors="replace").rstrip("\x00 \n\t")
    except OSError:
        return None


def is_real_root(root: str | Path) -> bool:
    return Path(root).resolve() == Path("/").resolve()


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """System memory in MiB; ``available_mb`` is MemAvailable."""

    total_mb: int
    available_mb: int
    free_mb: int
    swap_total_mb: int
    swap_free_mb: int


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as kB per key."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        number = rest.split()
        if number and number[0].isdigit():
            values[key.strip()] = int(number[0])
    return values


def read_memory(root: str | Path = "/") -> MemoryInfo:
    text = read_text(root, "/proc/meminfo")
    if text is None and is_real_root(root):
        return _memory_from_psutil()
    kb = parse_meminfo(text or "")
    # Kernels before 3.14 lack MemAvailable; there free + page cache is the estimate.
    available = kb.get("MemAvailable", kb.get("MemFree", 0) + kb.get("Cached", 0))
    return MemoryInfo(kb.get("MemTotal", 0) // 1024, available // 1024, kb.get("MemFree", 0) // 1024,
                      kb.get("SwapTotal", 0) // 1024, kb.get("SwapFree", 0) // 1024)


def _memory_from_psutil() -> MemoryInfo:
    virtual, swap = psutil.virtual_memory(), psutil.swap_memory()
    mib = 2**20
    return MemoryInfo(virtual.total // mib, virtual.available // mib, virtual.free // mib,
                      swap.total // mib, swap.free // mib)


@dataclass(frozen=True, slots=True)
class SwapDevice:
    name: str
    type: str
    size_mb: int
    used_mb: int

    @property
    def zram(self) -> bool:
        """zram compresses into the same DRAM: it stretches memory, it adds none."""
        return "zram" in self.name


def read_swaps(root: str | Path = "/") -> tuple[SwapDevice, ...]:
    text = read_text(root, "/proc/swaps") or ""
    devices = []
    for line in text.splitlines()[1:]:
        cells = line.split()
        if len(cells) >= 4 and cells[2].isdigit() and cells[3].isdigit():
            devices.append(SwapDevice(cells[0], cells[1], int(cells[2]) // 1024, int(cells[3]) // 1024))
    return tuple(devices)


# --------------------------------------------------------------------------- Jetson


def read_jetson_model(root: str | Path = "/") -> str | None:
    return read_text(root, "/proc/device-tree/model") or None


def read_compatible(root: str | Path = "/") -> tuple[str, ...]:
    """``/proc/device-tree/compatible``: NUL-separated, most specific first."""
    text = read_text(root, "/proc/device-tree/compatible") or ""
    return tuple(entry for entry in text.split("\x00") if entry)


def read_l4t_version(root: str | Path = "/") -> str | None:
    """``# R36 (release), REVISION: 4.3, ...`` → ``"36.4.3"``."""
    match = _RELEASE_LINE.search(read_text(root, "/etc/nv_tegra_release") or "")
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _is_jetson(model: str | None, compatible: tuple[str, ...], l4t: str | None) -> bool:
    named = bool(model) and "jetson" in model.lower()
    tegra = any(_TEGRA_COMPATIBLE.search(entry) for entry in compatible)
    return named or tegra or l4t is not None


_JETSON_SM = (("thor", "11.0"), ("orin", "8.7"), ("xavier", "7.2"))


def jetson_sm(model: str | None) -> str | None:
    """The GPU compute capability of a Jetson family, known without asking CUDA."""
    lowered = (model or "").lower()
    return next((sm for family, sm in _JETSON_SM if family in lowered), None)


# --------------------------------------------------------------------------- discrete GPU


@dataclass(frozen=True, slots=True)
class CudaProbe:
    """What the CUDA runtime says about GPU 0."""

    name: str
    sm: str
    memory_mb: int


def cuda_capability(device) -> tuple[int, int]:
    """The compute capability of the CUDA ``device`` (a ``torch.device``; the current one where it
    names no index), asked of torch once a GPU: kernels ask it on every launch they decide."""
    import torch

    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def probe_cuda() -> CudaProbe | None:
    """GPU 0 through torch, else NVML; None without a usable CUDA device."""
    return _probe_torch() or _probe_nvml()


def _probe_torch() -> CudaProbe | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return CudaProbe(props.name, f"{props.major}.{props.minor}", props.total_memory // 2**20)


def _probe_nvml() -> CudaProbe | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20
    except pynvml.NVMLError:
        return None
    return CudaProbe(name.decode() if isinstance(name, bytes) else name, f"{major}.{minor}", memory)


def read_driver_gpus(root: str | Path = "/") -> tuple[str, ...]:
    """GPU names the NVIDIA kernel driver lists, whether or not torch has CUDA."""
    folder = under(root, "/proc/driver/nvidia/gpus")
    names = []
    for info in sorted(folder.glob("*/information")):
        for line in (read_text(info.parent, "information") or "").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model" and value.strip():
                names.append(value.strip())
    return tuple(names)


def read_driver_version(root: str | Path = "/") -> str | None:
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", read_text(root, "/proc/driver/nvidia/version") or "")
    return match.group(1) if match else None


# --------------------------------------------------------------------------- the summary


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    kind: DeviceKind
    model: str | None
    compatible: tuple[str, ...]
    l4t_version: str | None
    jetpack: str | None
    memory_total_mb: int
    memory_available_mb: int
    cuda_device: str | None
    sm: str | None
    cuda_memory_mb: int | None
    unified: bool
    driver_version: str | None = None
    cpu_count: int = 1

    def describe(self) -> str:
        memory = f"{self.memory_total_mb} MiB"
        if self.kind == "jetson":
            return f"{self.model or 'unknown Jetson'} ({memory}, L4T {self.l4t_version or 'unknown'})"
        if self.kind == "cuda":
            return f"{self.model or self.cuda_device or 'CUDA GPU'} ({self.cuda_memory_mb or '?'} MiB GPU, {memory} host)"
        return f"CPU-only machine ({memory}, {self.cpu_count} cores)"


def _default_probe(root: str | Path) -> Callable[[], CudaProbe | None]:
    return probe_cuda if is_real_root(root) else (lambda: None)


def detect_device(root: str | Path = "/", *,
                  cuda_probe: Callable[[], CudaProbe | None] | None = None) -> DeviceInfo:
    """Describe the machine under ``root``.

    ``cuda_probe`` asks the CUDA runtime; by default torch/NVML on the real root and
    nothing under a fake tree, where a test may pass one to stand in for a GPU.
    """
    probe = (cuda_probe or _default_probe(root))()
    memory = read_memory(root)
    model, compatible, l4t = read_jetson_model(root), read_compatible(root), read_l4t_version(root)
    common = dict(memory_total_mb=memory.total_mb, memory_available_mb=memory.available_mb,
                  cuda_device=probe.name if probe else None, cpu_count=os.cpu_count() or 1,
                  driver_version=read_driver_version(root), compatible=compatible)
    if _is_jetson(model, compatible, l4t):
        release = jetpack_for_l4t(l4t)
        return DeviceInfo(kind="jetson", model=model, l4t_version=l4t,
                          jetpack=release.jetpack if release else None,
                          sm=probe.sm if probe else jetson_sm(model),
                          cuda_memory_mb=memory.total_mb, unified=True, **common)
    gpus = read_driver_gpus(root)
    if probe or gpus:
        return DeviceInfo(kind="cuda", model=gpus[0] if gpus else probe.name, l4t_version=None, jetpack=None,
                          sm=probe.sm if probe else None, cuda_memory_mb=probe.memory_mb if probe else None,
                          unified=False, **common)
    return DeviceInfo(kind="cpu", model=None, l4t_version=None, jetpack=None, sm=None,
                      cuda_memory_mb=None, unified=False, **common)
