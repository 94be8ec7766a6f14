"""The Triton products' tile choices, kept across processes for one GPU and one build of the kernels.

The fused decode step and the packed products choose their tiles by timing candidates on the
device: every candidate compiled, then replayed over each layer's weights, then the step's
tiles timed together (:mod:`edgeinfer.backends.torch.step_tuning`). For a 4-bit model that is
most of a load, and it fell on every process: each ``edgeinfer run``, each start of the daemon.
As TensorRT keeps a timing cache, the choices are kept here, in one file per GPU and software,
and a later process with the same identity takes them and times nothing.

The identity (:func:`identity`) is all that can change a choice: the GPU's name, compute
capability, multiprocessor count and L2 size; torch, CUDA and Triton's versions; and a digest
of the kernels' and tuners' source files, so a changed kernel never meets a tile chosen for the
old one. Within a file an entry is one tuning's answer (a ``kind`` and its ``key``: the shapes,
formats and settings it was timed for).

Where (:func:`default`): ``$EDGEINFER_TILE_CACHE`` (a folder; ``off`` keeps nothing), else
``tiles`` under :func:`~edgeinfer.artifacts.cache_home` (``$XDG_CACHE_HOME/edgeinfer/tiles``, else
``~/.cache/edgeinfer/tiles``)::

    <folder>/<gpu>-<identity digest>.json   {"identity": {...}, "entries": {"<kind>/<key digest>": {...}}}

Deleting the folder makes the next load time everything again. A file that cannot be read or
written costs a warning and a tuning, never a load. Two processes tuning at once each write the
whole file by rename, so the file is always whole; the later rename keeps its own entries and
those it read, which may lose the other's newest entry (it is timed again on the next load).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import threading
import warnings
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from edgeinfer.artifacts import cache_home

TILE_CACHE_ENV = "EDGEINFER_TILE_CACHE"
OFF = "off"
SCHEMA = 1
# The modules whose source decides what a tile does or how fast: their bytes are in the identity.
KERNEL_MODULES = (
    "edgeinfer.quant.kernels",
    "edgeinfer.quant.tensor_core",
    "edgeinfer.quant.staged",
    "edgeinfer.backends.torch.triton_decode",
    "edgeinfer.backends.torch.decode_attention",
    "edgeinfer.backends.torch.step_ends",
    "edgeinfer.backends.torch.step_tuning",
)


def default_folder() -> Path | None:
    """``$EDGEINFER_TILE_CACHE`` (None where it says ``off``), else ``$XDG_CACHE_HOME/edgeinfer/tiles``,
    else ``~/.cache/edgeinfer/tiles``."""
    chosen = os.environ.get(TILE_CACHE_ENV)
    if chosen is not None and chosen.strip():
        return None if chosen.strip().lower() == OFF else Path(chosen)
    return cache_home() / "tiles"


def default() -> TileCache:
    """The cache this process uses, as the environment names it now (:func:`default_folder`)."""
    return TileCache(default_folder())


def sources_digest(modules: tuple[str, ...]) -> str:
    """sha256 over the names and source files of ``modules`` (found, not imported; a missing one counts as such)."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        digest.update(name.encode())
        digest.update(Path(origin).read_bytes() if origin and Path(origin).is_file() else b"missing")
    return digest.hexdigest()


@functools.cache
def kernels_digest() -> str:
    """:func:`sources_digest` of :data:`KERNEL_MODULES`, once per process."""
    return sources_digest(KERNEL_MODULES)


@functools.cache
def identity(index: int) -> dict[str, Any]:
    """What a tile choice on CUDA device ``index`` depends on besides its own key."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - nothing is tuned without Triton
        triton_version = None
    props = torch.cuda.get_device_properties(index)
    return {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(index)),
            "multiprocessors": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "kernels": kernels_digest(), "schema": SCHEMA}


def device_identity(device) -> dict[str, Any] | None:
    """:func:`identity` of a ``torch.device``; None where it is not a CUDA device (nothing is timed there)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return identity(device.index if device.index is not None else torch.cuda.current_device())


def _digest(value: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def file_name(ident: Mapping[str, Any]) -> str:
    """``<gpu>-<digest>.json``: the GPU's name made safe for a file name, then the identity's digest."""
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", str(ident.get("gpu", "gpu"))).strip("-").lower() or "gpu"
    return f"{gpu}-{_digest(ident)[:16]}.json"


# Files read in this process, by path: a load asks for several entries of one file.
_READ: dict[Path, dict[str, Any]] = {}
_LOCK = threading.Lock()
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


class TileCache:
    """Tile choices in ``folder`` (None: nothing kept, every lookup misses), one file per identity."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def path(self, ident: Mapping[str, Any]) -> Path | None:
        """The file that holds choices made under ``ident`` (None: the cache is off)."""
        return None if self.folder is None else self.folder / file_name(ident)

    def get(self, kind: str, key: Mapping[str, Any], ident: Mapping[str, Any]) -> dict[str, Any] | None:
        """The value stored for ``kind`` and ``key`` under ``ident``, else None."""
        path = self.path(ident)
        if path is None:
            return None
        with _LOCK:
            if path not in _READ:
                _READ[path] = self._read(path, ident)
            entry = _READ[path].get(f"{kind}/{_digest(key)}")
        if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key)):
            return None
        value = entry.get("value")
        return value if isinstance(value, dict) else None

    def put(self, kind: str, key: Mapping[str, Any], value: Mapping[str, Any], ident: Mapping[str, Any]) -> None:
        """Store ``value`` for ``kind`` and ``key`` under ``ident``: the file read again, the entry
        set, the whole written to a temporary file and renamed over it. A folder that cannot be
        written is a warning (once), not an error."""
        path = self.path(ident)
        if path is None:
            return
        entry = {"key": key, "value": value, "saved": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        with _LOCK:
            entries = self._read(path, ident)
            entries[f"{kind}/{_digest(key)}"] = json.loads(json.dumps(entry))
            temporary = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # opened as any new file is (the umask's mode, not a temporary file's 0600)
                with open(temporary, "w") as tmp:
                    json.dump({"identity": ident, "entries": entries}, tmp, indent=1, sort_keys=True)
                os.replace(temporary, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    temporary.unlink()
                _warn_once(f"tile choices not kept in {path.parent} ({exc}): the next load times its tiles again; "
                           f"set {TILE_CACHE_ENV} to a writable folder, or to '{OFF}'")
                return
            _READ[path] = entries

    @staticmethod
    def _read(path: Path, ident: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``path``; none where it is missing, unreadable, not this schema's JSON or
        written under another identity (a warning for all but the first)."""
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except (OSError, ValueError) as exc:
            _warn_once(f"ignoring the tile cache {path}: {exc}")
            return {}
        if (not isinstance(data, dict) or data.get("identity") != json.loads(json.dumps(ident))
                or not isinstance(data.get("entries"), dict)):
            _warn_once(f"ignoring the tile cache {path}: not a tile cache for this GPU and build")
            return {}
        return dict(data["entries"])


def forget_reads() -> None:
    """Drop the files read in this process (tests: another process wrote them)."""
    with _LOCK:
        _READ.clear()
