"""The persisted cache as a whole: what it holds, clearing it, checking every checksum.

A cache root (``kv.disk_dir``, default :func:`~edgeinfer.kv.disk.default_cache_dir`) holds
one folder per (model fingerprint, codec, block geometry); see :mod:`edgeinfer.kv.disk`. Each
folder is opened through :class:`~edgeinfer.kv.disk.DiskStore` (which takes its lock, so a
folder a running engine holds is reported busy and left alone) and its vision files are read
through :class:`~edgeinfer.kv.embeddings.EmbeddingStore`: the formats are known there only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgeinfer.kv.disk import (
    FORMAT_VERSION,
    ChecksumError,
    DiskBusyError,
    DiskLayout,
    DiskStore,
)
from edgeinfer.kv.embeddings import EmbeddingStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FolderReport:
    """One model's folder: what it holds, or why it was left alone, and what was done to it."""

    digest: str
    fingerprint: str = ""
    codec: str = ""
    geometry: str = ""
    kv_blocks: int = 0
    kv_bytes: int = 0  # blocks.dat and index.log on disk
    vision_entries: int = 0
    vision_bytes: int = 0
    skipped: str = ""  # why nothing was read or done (busy, not a cache folder)
    removed_blocks: int = 0
    removed_vision: int = 0
    damaged_blocks: int = 0
    damaged_vision: int = 0
    freed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CacheReport:
    root: str
    action: str  # stats, clear or verify
    folders: tuple[FolderReport, ...] = field(default_factory=tuple)

    def totals(self) -> dict[str, int]:
        keys = ("kv_blocks", "kv_bytes", "vision_entries", "vision_bytes", "removed_blocks", "removed_vision",
                "damaged_blocks", "damaged_vision", "freed_bytes")
        return {key: sum(getattr(f, key) for f in self.folders) for key in keys}

    def to_dict(self) -> dict:
        return {"root": self.root, "action": self.action, "totals": self.totals(),
                "folders": [asdict(f) for f in self.folders]}


# --------------------------------------------------------------------------- folders


def model_folders(root: Path) -> list[Path]:
    base = Path(root).expanduser() / f"v{FORMAT_VERSION}"
    return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def folder_layout(folder: Path) -> DiskLayout | None:
    """The layout ``meta.json`` names, when it is the one the folder's name stands for."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        layout = DiskLayout(meta["fingerprint"], meta["codec"], meta["geometry"], int(meta["nbytes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return layout if layout.digest() == folder.name and layout.nbytes > 0 else None


def _slots_on_disk(folder: Path, nbytes: int) -> int:
    data = folder / "blocks.dat"
    return data.stat().st_size // nbytes if data.exists() else 0


def _kv_bytes(folder: Path) -> int:
    return sum((folder / n).stat().st_size for n in ("blocks.dat", "index.log") if (folder / n).exists())


def _vision_files(folder: Path) -> list[Path]:
    vision = folder / "vision"
    return sorted(vision.glob("*.emb")) if vision.is_dir() else []


@contextmanager
def _held(root: Path, folder: Path, layout: DiskLayout, capacity: int | None = None) -> Iterator[DiskStore]:
    """The folder's store, its lock held; ``capacity`` None keeps every block the file has."""
    slots = _slots_on_disk(folder, layout.nbytes) if capacity is None else capacity
    store = DiskStore(Path(root).expanduser(), layout, slots)
    try:
        yield store
    finally:
        store.close()


def _describe(folder: Path, layout: DiskLayout, store: DiskStore, **done: int) -> FolderReport:
    files = _vision_files(folder)
    return FolderReport(folder.name, layout.fingerprint, layout.codec, layout.geometry,
                        kv_blocks=len(store.records), kv_bytes=_kv_bytes(folder), vision_entries=len(files),
                        vision_bytes=sum(f.stat().st_size for f in files), **done)


def _each_folder(root: Path, model: str | None, work) -> list[FolderReport]:
    reports = []
    for folder in model_folders(root):
        layout = folder_layout(folder)
        if layout is None:
            if model is None:
                reports.append(FolderReport(folder.name, skipped="not a cache folder (meta.json missing or "
                                                                   "does not match the folder's name)"))
            continue
        if model is not None and not (folder.name.startswith(model) or layout.fingerprint.startswith(model)):
            continue
        try:
            reports.append(work(folder, layout))
        except DiskBusyError:
            reports.append(FolderReport(folder.name, layout.fingerprint, layout.codec, layout.geometry,
                                        skipped="in use by a running engine; ask its daemon (/admin/cache)"))
    return reports


# --------------------------------------------------------------------------- actions


def cache_stats(root: Path, model: str | None = None, live: DiskStore | None = None) -> CacheReport:
    """Tiers, blocks, bytes and vision entries of every model folder under ``root``. ``live``: the
    store a running engine holds (call on its thread); its folder is described from it."""
    def stats(folder: Path, layout: DiskLayout) -> FolderReport:
        if live is not None and live.dir.resolve() == folder.resolve():
            return _describe(folder, layout, live)
        with _held(root, folder, layout) as store:
            return _describe(folder, layout, store)

    return CacheReport(str(root), "stats", tuple(_each_folder(root, model, stats)))


def clear_cache(root: Path, model: str | None = None, *, kv: bool = True, vision: bool = True) -> CacheReport:
    """Remove the KV blocks and/or the vision entries of the folders matching ``model`` (a digest or
    fingerprint prefix; None: all)."""
    def clear(folder: Path, layout: DiskLayout) -> FolderReport:
        before = _kv_bytes(folder) + sum(f.stat().st_size for f in _vision_files(folder))
        with _held(root, folder, layout) as store:
            blocks = len(store.records)
        removed_vision = 0
        # The store's own rule empties it: opened with no room, it drops every block and truncates the file.
        with _held(root, folder, layout, capacity=0 if kv else None) as store:
            if vision:
                for path in _vision_files(folder):
                    path.unlink(missing_ok=True)
                    removed_vision += 1
            after = _kv_bytes(folder) + sum(f.stat().st_size for f in _vision_files(folder))
            return _describe(folder, layout, store, removed_blocks=blocks if kv else 0,
                             removed_vision=removed_vision, freed_bytes=max(0, before - after))

    return CacheReport(str(root), "clear", tuple(_each_folder(root, model, clear)))


def verify_cache(root: Path, model: str | None = None) -> CacheReport:
    """Check every KV block and vision entry against its checksum; remove those that fail."""
    def verify(folder: Path, layout: DiskLayout) -> FolderReport:
        before = _kv_bytes(folder) + sum(f.stat().st_size for f in _vision_files(folder))
        with _held(root, folder, layout) as store:
            damaged_blocks = store.repaired  # journal lines or blocks the store dropped while opening
            for slot, record in sorted(store.records.items()):
                try:
                    store.read(slot, record.key)
                except ChecksumError:
                    store.release(slot)
                    damaged_blocks += 1
            damaged_vision = _verify_vision(folder, layout)
            after = _kv_bytes(folder) + sum(f.stat().st_size for f in _vision_files(folder))
            return _describe(folder, layout, store, damaged_blocks=damaged_blocks, damaged_vision=damaged_vision,
                             removed_blocks=damaged_blocks, removed_vision=damaged_vision,
                             freed_bytes=max(0, before - after))

    return CacheReport(str(root), "verify", tuple(_each_folder(root, model, verify)))


def _verify_vision(folder: Path, layout: DiskLayout) -> int:
    """Vision entries that cannot be used (damaged, or written for another image or model); each is removed."""
    store = EmbeddingStore(folder / "vision", owner=layout.fingerprint)
    damaged = 0
    for key in list(store.keys()):
        problem = store.verify(key)
        if problem is not None:
            log.warning("vision cache entry %s removed: %s", key, problem)
            store.discard(key)
            damaged += 1
    return damaged
