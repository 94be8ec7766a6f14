"""Sleep levels and where the weights wait while the engine sleeps.

Level 1 keeps the weights out of the device but close at hand: on a GPU in pinned host
memory (on unified memory that frees them from the device allocator; they stay in a
host mapping), on a CPU in an unlinked file of the cache folder, which the kernel may
write back and reclaim (the process's own memory is released). Level 2 keeps nothing:
the weights are read from the checkpoint again on wake.

At either level the tensor objects stay and only their ``.data`` changes: whatever holds
them (compiled code guarding on their shapes, strides and dtypes; an engine reading them) is
still valid after a wake, which then compiles nothing again.
"""

from __future__ import annotations

import enum
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgeinfer.errors import ModelLoadError, RequestError


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
    last_wake_captures: int = 0  # graphs the last wake captured again (its engines had them before)
    last_wake_capture_s: float = 0.0  # the share of the last wake those captures took


def _named_tensors(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``modules`` by ``<module>.<name>``, each once (tied weights are
    one tensor, under its first name)."""
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    for prefix, module in modules.items():
        named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
        for name, t in named:
            seen.setdefault(id(t), (f"{prefix}.{name}", t))
    return dict(seen.values())


@dataclass(frozen=True, slots=True)
class _Slot:
    name: str
    tensor: torch.Tensor  # the module's own tensor object; only its ``.data`` changes
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    offset: int = 0
    nbytes: int = 0


def _slot(name: str, t: torch.Tensor, offset: int = 0) -> _Slot:
    return _Slot(name, t, tuple(t.shape), tuple(t.stride()), t.dtype, t.device, offset, t.numel() * t.element_size())


def _release(slot: _Slot) -> None:
    """Let go of ``slot``'s storage; the tensor object keeps its dtype and device."""
    slot.tensor.data = torch.empty(0, dtype=slot.dtype, device=slot.device)


class PinnedHostStash:
    """Weights copied to pinned host memory; the device copies are released. ``restore`` puts every
    tensor back where it was, with its shape, strides and dtype."""

    kind = "pinned-host"

    @torch.no_grad()
    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self._slots: list[tuple[_Slot, torch.Tensor]] = []
        for name, t in _named_tensors(modules).items():
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu",
                                       pin_memory=torch.cuda.is_available())
            host.copy_(t, non_blocking=True)
            self._slots.append((_slot(name, t), host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for slot, host in self._slots:
            slot.tensor.data = host if slot.device.type == "cpu" else torch.empty(0, dtype=slot.dtype)

    @property
    def slots(self) -> list[_Slot]:
        return [slot for slot, _ in self._slots]

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
    def __init__(self, modules: dict[str, torch.nn.Module], folder: Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=folder, prefix="edgeinfer-weights-")  # noqa: SIM115 - open until restore
        self._slots: list[_Slot] = []
        offset = 0
        for name, t in _named_tensors(modules).items():
            slot = _slot(name, t, offset)
            self._file.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            self._slots.append(slot)
            offset += slot.nbytes
        self._file.flush()
        for slot in self._slots:
            _release(slot)

    @property
    def slots(self) -> list[_Slot]:
        return list(self._slots)

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


class WeightsChanged(ModelLoadError):
    """The checkpoint read at a wake does not have the tensors the sleeping model had (the engine
    then opens its engines again over the new load)."""


class DroppedWeights:
    """Level 2: every tensor's storage released; each tensor object stays with its shape, strides,
    dtype and device written down, so a wake refills it in place from a fresh load."""

    kind = "dropped"

    def __init__(self, slots: Iterable[_Slot]) -> None:
        self._slots = list(slots)
        for slot in self._slots:
            _release(slot)

    @classmethod
    def of(cls, modules: dict[str, torch.nn.Module]) -> DroppedWeights:
        return cls(_slot(name, t) for name, t in _named_tensors(modules).items())

    @torch.no_grad()
    def refill(self, modules: dict[str, torch.nn.Module]) -> None:
        """Give every sleeping tensor the values of its namesake in ``modules`` (a fresh load of the
        same checkpoint), laid out as it was; ``modules`` gives its storage up as it goes, so the
        model is in memory about once. Raises WeightsChanged, refilling nothing, where a name,
        shape or dtype differs."""
        fresh = _named_tensors(modules)
        self._require_same(fresh)
        for slot in self._slots:
            new = fresh[slot.name]
            if new.device == slot.device and tuple(new.stride()) == slot.stride:
                slot.tensor.data = new.data
            else:  # re-laid out by its engine (strides) since it was loaded: copied into that layout
                out = torch.empty_strided(slot.shape, slot.stride, dtype=slot.dtype, device=slot.device)
                slot.tensor.data = out.copy_(new)
            new.data = torch.empty(0, dtype=new.dtype, device=new.device)
        self._slots = []

    def _require_same(self, fresh: dict[str, torch.Tensor]) -> None:
        mine = {s.name: (s.shape, s.dtype) for s in self._slots}
        theirs = {name: (tuple(t.shape), t.dtype) for name, t in fresh.items()}
        if mine != theirs:
            differ = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))
            raise WeightsChanged(f"{len(differ)} tensors differ from the sleeping model's "
                                 f"(e.g. {', '.join(differ[:3])})")


def stash_weights(modules: dict[str, torch.nn.Module], device: str, folder: Path) -> PinnedHostStash | FileStash:
    """Level 1's home for the weights: pinned host memory under a GPU, a file on a CPU."""
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
