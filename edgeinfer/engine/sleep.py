"""Sleep levels and where the weights wait while the engine sleeps.

Level 1 keeps the weights out of the device but close at hand: on a GPU in pinned host
memory (on unified memory that frees them from the device allocator; they stay in a
host mapping), on a CPU in an unlinked file of the cache folder, which the kernel may
write back and reclaim (the process's own memory is released). Level 2 keeps nothing:
the weights are read from the checkpoint again on wake.
"""

from __future__ import annotations

import enum
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from edgeinfer.errors import RequestError


class SleepLevel(enum.IntEnum):
    AWAKE = 0
    OFFLOAD = 1  # KV freed, weights to host memory (or a file on a CPU)
    DISCARD = 2  # KV freed, weights dropped and reloaded from the checkpoint

    @classmethod
    def parse(cls, value: int | str) -> SleepLevel:
        """1 or 2; anything else is a RequestError naming the valid levels."""
        try:
            level = cls(int(value))
        except (TypeError, ValueError):
            level = None
        if level is None or level is cls.AWAKE:
            raise RequestError(f"sleep level must be 1 (weights to host memory) or 2 (weights dropped), "
                               f"got {value!r}")
        return level


@dataclass(frozen=True, slots=True)
class SleepReport:
    """What one sleep did."""

    level: int
    seconds: float
    persisted_blocks: int  # KV blocks written to the disk tier on the way down
    freed_kv_bytes: int  # the device pool's k and v tensors
    weights: str  # "pinned-host", "host-file" or "dropped"


@dataclass(slots=True)
class SleepStats:
    """Counts since the engine loaded (read by the daemon's metrics)."""

    level: int = 0
    sleeps: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    wakes: int = 0
    wake_s_total: float = 0.0
    last_wake_s: float = 0.0


class WeightStash(Protocol):
    kind: str

    def restore(self) -> None:
        """Put every tensor back where it was, with its shape, strides and dtype."""


def _tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of ``modules``, each once (tied weights are one tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            seen.setdefault(id(t), t)
    return list(seen.values())


@dataclass(frozen=True, slots=True)
class _Slot:
    tensor: torch.Tensor  # the module's own tensor object; only its ``.data`` changes
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    offset: int = 0
    nbytes: int = 0


def _slot(t: torch.Tensor, offset: int = 0) -> _Slot:
    return _Slot(t, tuple(t.shape), tuple(t.stride()), t.dtype, t.device, offset, t.numel() * t.element_size())


class PinnedHostStash:
    """Weights copied to pinned host memory; the device copies are released."""

    kind = "pinned-host"

    @torch.no_grad()
    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self._slots = []
        for t in _tensors(modules):
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu",
                                       pin_memory=torch.cuda.is_available())
            host.copy_(t, non_blocking=True)
            self._slots.append((_slot(t), host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for slot, host in self._slots:
            slot.tensor.data = host if slot.device.type == "cpu" else torch.empty(0, dtype=slot.dtype)

    @torch.no_grad()
    def restore(self) -> None:
        for slot, host in self._slots:
            slot.tensor.data = host.to(slot.device, non_blocking=True) if slot.device.type != "cpu" else host
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._slots = []


class FileStash:
    """Weights written to an unlinked file under ``folder``; the process's copies are released.
    The file vanishes with the process, whatever way it ends."""

    kind = "host-file"

    @torch.no_grad()
    def __init__(self, modules: Iterable[torch.nn.Module], folder: Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=folder, prefix="edgeinfer-weights-")  # noqa: SIM115 - open until restore
        self._slots: list[_Slot] = []
        offset = 0
        for t in _tensors(modules):
            slot = _slot(t, offset)
            self._file.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            self._slots.append(slot)
            offset += slot.nbytes
        self._file.flush()
        for slot in self._slots:
            slot.tensor.data = torch.empty(0, dtype=slot.dtype, device=slot.device)

    @torch.no_grad()
    def restore(self) -> None:
        for slot in self._slots:
            raw = torch.empty(slot.nbytes, dtype=torch.uint8)
            self._file.seek(slot.offset)
            got = self._file.readinto(memoryview(raw.numpy()))
            if got != slot.nbytes:
                raise OSError(f"the weights file gave {got} of {slot.nbytes} bytes")
            dense = raw.view(slot.dtype).view(slot.shape) if slot.nbytes else torch.empty(slot.shape, dtype=slot.dtype)
            out = torch.empty_strided(slot.shape, slot.stride, dtype=slot.dtype, device=slot.device)
            slot.tensor.data = out.copy_(dense)
        self._file.close()
        self._slots = []


def stash_weights(modules: Iterable[torch.nn.Module], device: str, folder: Path) -> WeightStash:
    """Level 1's home for the weights: pinned host memory under a GPU, a file on a CPU."""
    modules = list(modules)
    if device.startswith("cuda"):
        return PinnedHostStash(modules)
    return FileStash(modules, folder)


def release_unused_memory() -> None:
    """Hand freed memory back to the system: cuBLAS's per-stream workspaces, the CUDA
    allocator's cache, and glibc's free lists."""
    import ctypes
    import gc

    gc.collect()
    if torch.cuda.is_available():
        # cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it ran on, the CUDA-graph
        # capture streams included; each wake captures on new streams, so without this the
        # sleeping process kept 32 MiB more after every sleep/wake cycle.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass
