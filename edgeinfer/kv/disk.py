"""The disk tier: encoded blocks in one slotted file, a journal that survives restarts.

Layout of a cache directory (``kv.disk_dir``, default ``$XDG_CACHE_HOME/edgeinfer/kv``)::

    v1/                       format version: a new layout gets a new folder
      <digest>/               one per (model fingerprint, codec, block geometry)
        meta.json             what the digest stands for, checked on open
        blocks.dat            slot i at byte i * nbytes
        index.log             the journal: one line per stored or deleted block
        lock                  held (flock) by the one process using this folder
        vision/<hash>.emb     vision engine outputs, by image content hash (kv/embeddings.py)

A journal line is ``P slot key valid crc aliases linecrc`` (a block was stored) or
``D slot linecrc`` (it was deleted); ``crc`` covers the block key and its bytes, and
``linecrc`` the line itself. A store writes the bytes first and the ``P`` line after;
a slot is reused only after its ``D`` line. So a process killed at any point leaves
either no line (the slot is free), a torn last line (dropped on the next open, which
rewrites a compact journal), or a complete line whose bytes the checksum verifies on
every load. A block that fails its checksum is deleted and recomputed, never used.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import heapq
import json
import logging
import os
import threading
import weakref
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class ChecksumError(Exception):
    """A block's bytes do not match the checksum stored with it."""


class DiskBusyError(Exception):
    """Another process holds this cache directory."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/edgeinfer/kv``, else ``~/.cache/edgeinfer/kv``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgeinfer" / "kv"


@dataclass(frozen=True, slots=True)
class DiskLayout:
    """What a cache folder must match to be reused: the model and how blocks are encoded."""

    fingerprint: str
    codec: str
    geometry: str
    nbytes: int

    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class DiskRecord:
    key: bytes
    valid: int
    crc: int
    aliases: tuple[tuple[bytes, int], ...] = ()


def _line(body: str) -> bytes:
    return f"{body} {zlib.crc32(body.encode()):08x}\n".encode()


def _parse(raw: bytes) -> tuple[str, int, DiskRecord | None] | None:
    """(kind, slot, record) of one journal line, or None when it is torn or damaged."""
    try:
        text = raw.decode()
        body, _, check = text.rpartition(" ")
        if int(check, 16) != zlib.crc32(body.encode()):
            return None
        parts = body.split(" ")
        if parts[0] == "D" and len(parts) == 2:
            return "D", int(parts[1]), None
        if parts[0] == "P" and len(parts) == 6:
            aliases = () if parts[5] == "-" else tuple(
                (bytes.fromhex(a), int(j)) for a, j in (item.split(":") for item in parts[5].split(",")))
            return "P", int(parts[1]), DiskRecord(bytes.fromhex(parts[2]), int(parts[3]), int(parts[4], 16), aliases)
    except (ValueError, UnicodeDecodeError):
        return None
    return None


def _record_line(slot: int, r: DiskRecord) -> bytes:
    aliases = ",".join(f"{a.hex()}:{j}" for a, j in r.aliases) or "-"
    return _line(f"P {slot} {r.key.hex()} {r.valid} {r.crc:08x} {aliases}")


def block_crc(key: bytes, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(key))


def _release(fds: list[int], lock_fd: int) -> None:
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    os.close(lock_fd)  # closing the descriptor drops the flock


def open_disk_tier(root: Path, layout: DiskLayout, capacity: int) -> DiskStore | None:
    """The disk tier under ``root``, or None (with a warning) when the folder is busy or unusable:
    the engine then runs without one."""
    try:
        return DiskStore(root, layout, capacity)
    except DiskBusyError as error:
        log.warning("%s; this engine runs without a disk tier", error)
    except OSError as error:
        log.warning("cannot use KV cache folder %s (%s); this engine runs without a disk tier", root, error)
    return None


class DiskStore:
    """Slots of ``layout.nbytes`` in ``blocks.dat``; ``capacity`` slots at most.

    ``reserve``/``release`` run on the manager's thread; ``write``/``read`` on the spill
    worker. The journal and the record map are guarded by one lock.
    """

    def __init__(self, root: Path, layout: DiskLayout, capacity: int) -> None:
        self.layout = layout
        self.nbytes = layout.nbytes
        self.dir = Path(root) / f"v{FORMAT_VERSION}" / layout.digest()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        self._mutex = threading.Lock()
        self.repaired = 0  # journal lines or blocks dropped while opening
        self._check_meta()
        self._data = os.open(self.dir / "blocks.dat", os.O_RDWR | os.O_CREAT, 0o644)
        self.capacity = max(0, capacity)
        self.records = self._replay()
        self._journal = os.open(self.dir / "index.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # Dropped without close(): the files are still synced and the folder's lock released.
        self._finalizer = weakref.finalize(self, _release, [self._journal, self._data], self._lock_fd)
        self._free = [s for s in range(self.capacity) if s not in self.records]
        heapq.heapify(self._free)
        self._in_use = set(self.records)

    # --- opening -------------------------------------------------------------------
    def _take_lock(self) -> int:
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DiskBusyError(f"{self.dir} is in use by another process") from None
        return fd

    def _check_meta(self) -> None:
        meta = self.dir / "meta.json"
        expected = {"format": FORMAT_VERSION, **asdict(self.layout)}
        try:
            found = json.loads(meta.read_text())
        except (OSError, ValueError):
            found = None
        if found == expected:
            return
        if found is not None:
            log.warning("KV cache folder %s was written for another model or layout; starting it afresh", self.dir)
        for name in ("blocks.dat", "index.log"):
            (self.dir / name).unlink(missing_ok=True)
        tmp = meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(expected, indent=1))
        os.replace(tmp, meta)

    def _replay(self) -> dict[int, DiskRecord]:
        path = self.dir / "index.log"
        raw = path.read_bytes() if path.exists() else b""
        lines = raw.split(b"\n")
        dropped = 1 if lines.pop() else 0  # bytes after the last newline: a torn line
        records: dict[int, DiskRecord] = {}
        for i, line in enumerate(lines):
            parsed = _parse(line)
            if parsed is None:
                dropped += len(lines) - i
                break
            kind, slot, record = parsed
            if kind == "P":
                records[slot] = record
            else:
                records.pop(slot, None)
        size = os.fstat(self._data).st_size
        fits = {s: r for s, r in records.items() if s < self.capacity and (s + 1) * self.nbytes <= size}
        dropped += len(records) - len(fits)
        if size > self.capacity * self.nbytes:
            os.ftruncate(self._data, self.capacity * self.nbytes)
        self.repaired = dropped
        if dropped:
            log.warning("KV cache journal %s: %d damaged or stale entries dropped", path, dropped)
        self._rewrite(path, fits)
        return fits

    def _rewrite(self, path: Path, records: dict[int, DiskRecord]) -> None:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.writelines(_record_line(s, r) for s, r in sorted(records.items()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # --- slots (manager thread) ------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self._in_use)

    def reserve(self) -> int | None:
        while self._free:
            slot = heapq.heappop(self._free)
            if slot < self.capacity:
                self._in_use.add(slot)
                return slot
        return None

    def release(self, slot: int) -> None:
        """Free a slot; a stored block is deleted in the journal before its slot can be reused."""
        if slot not in self._in_use:
            raise ValueError(f"disk slot {slot} is not in use")
        with self._mutex:
            if self.records.pop(slot, None) is not None:
                self._append(_line(f"D {slot}"))
        self._in_use.discard(slot)
        if slot < self.capacity:
            heapq.heappush(self._free, slot)

    def shrink_to_file(self) -> int:
        """After a full disk: keep only the slots the file already has room for; returns the new capacity."""
        self.capacity = min(self.capacity, os.fstat(self._data).st_size // self.nbytes)
        return self.capacity

    # --- bytes (spill worker) --------------------------------------------------------
    def write(self, slot: int, key: bytes, valid: int, aliases: tuple[tuple[bytes, int], ...], payload) -> None:
        """Store one block's bytes, then its journal line."""
        self._write_bytes(slot, payload)
        record = DiskRecord(key, valid, block_crc(key, payload), tuple(aliases))
        with self._mutex:
            self._append(_record_line(slot, record))
            self.records[slot] = record

    def _append(self, line: bytes) -> None:
        """One journal line in one write (O_APPEND): a crash leaves it whole or torn at the end."""
        done = 0
        while done < len(line):
            done += os.write(self._journal, line[done:])

    def _write_bytes(self, slot: int, payload) -> None:
        view = memoryview(payload).cast("B")
        if view.nbytes != self.nbytes:
            raise ValueError(f"block of {view.nbytes} bytes for slots of {self.nbytes}")
        offset, done = slot * self.nbytes, 0
        while done < view.nbytes:
            written = os.pwrite(self._data, view[done:], offset + done)
            if written <= 0:
                raise OSError(errno.ENOSPC, "short write")
            done += written

    def read(self, slot: int, key: bytes) -> bytearray:
        """The block's bytes, verified against its journal record and ``key``."""
        with self._mutex:
            record = self.records.get(slot)
        data = bytearray(self.nbytes)
        got = os.preadv(self._data, [data], slot * self.nbytes)
        if record is None or record.key != key or got != self.nbytes or block_crc(key, data) != record.crc:
            raise ChecksumError(f"block in slot {slot} of {self.dir / 'blocks.dat'} fails its checksum")
        return data

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget cached pages of the block file, so the next reads hit the device."""
        os.fsync(self._data)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._data, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with self._mutex:
            self._finalizer()
