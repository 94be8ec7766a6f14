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

A full filesystem never costs what the tier already holds. Opening needs no free space:
the journal is compacted only when it has something to drop, and when that rewrite fails
the old journal is kept (cut after its last sound line, which frees space rather than
taking it) and no temporary file is left. Writing stops before the filesystem is left
with less than its free margin (:class:`FreeSpace`, 5% of the filesystem by default):
the tier opens at most that large, and a store that would go past the margin, or that
meets ENOSPC, turns the tier read-only: it keeps serving what it has, and takes no new
blocks for the rest of the process (the spill manager warns once).
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

from edgeinfer.artifacts import cache_home

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DEFAULT_FREE_MARGIN = 0.05  # of the filesystem's size, kept free by the cache


class ChecksumError(Exception):
    """A block's bytes do not match the checksum stored with it."""


class DiskBusyError(Exception):
    """Another process holds this cache directory."""


class DiskFullError(OSError):
    """A write would leave the filesystem with less than its free margin (errno ENOSPC)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


@dataclass(frozen=True, slots=True)
class FreeSpace:
    """The free space a cache folder's filesystem keeps: ``margin`` bytes (None: ``DEFAULT_FREE_MARGIN``
    of the filesystem's size) are never taken by the cache."""

    path: Path
    margin: int | None = None

    def _stat(self) -> os.statvfs_result:
        return os.statvfs(self.path)

    def margin_bytes(self) -> int:
        if self.margin is not None:
            return self.margin
        st = self._stat()
        return int(st.f_blocks * st.f_frsize * DEFAULT_FREE_MARGIN)

    def room(self) -> int:
        """Bytes the cache may still take (negative when the filesystem is already under its margin)."""
        st = self._stat()
        return st.f_bavail * st.f_frsize - self.margin_bytes()

    def require(self, nbytes: int) -> None:
        """Raise :class:`DiskFullError` when writing ``nbytes`` more would go past the margin."""
        room = self.room()
        if nbytes > room:
            raise DiskFullError(f"writing {nbytes} bytes to {self.path} would leave the filesystem under its "
                                f"free margin of {self.margin_bytes()} bytes ({max(room, 0)} bytes to spare)")


def default_cache_dir() -> Path:
    """``kv`` under :func:`~edgeinfer.artifacts.cache_home`: ``$XDG_CACHE_HOME/edgeinfer/kv``, else
    ``~/.cache/edgeinfer/kv``."""
    return cache_home() / "kv"


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
        try:
            os.fsync(fd)
        except OSError as error:  # a full disk may refuse the flush; what the journal lacks is recomputed
            log.warning("KV cache files could not be flushed: %s", error)
        os.close(fd)
    os.close(lock_fd)  # closing the descriptor drops the flock


def open_disk_tier(root: Path, layout: DiskLayout, capacity: int, free_margin: int | None = None) -> DiskStore | None:
    """The disk tier under ``root``, or None (with a warning) when the folder is busy or unusable:
    the engine then runs without one."""
    try:
        return DiskStore(root, layout, capacity, free_margin)
    except DiskBusyError as error:
        log.warning("%s; this engine runs without a disk tier", error)
    except OSError as error:
        log.warning("cannot use KV cache folder %s (%s); this engine runs without a disk tier", root, error)
    return None


class DiskStore:
    """Slots of ``layout.nbytes`` in ``blocks.dat``; ``capacity`` slots at most.

    ``reserve``/``release`` run on the manager's thread; ``write``/``read`` on the spill
    worker. The journal and the record map are guarded by one lock. ``capacity`` is the
    most the tier takes; it opens smaller when the filesystem's free margin says so.
    ``verify(slot)`` checks one stored block without changing anything.
    """

    def __init__(self, root: Path, layout: DiskLayout, capacity: int, free_margin: int | None = None) -> None:
        self.layout = layout
        self.nbytes = layout.nbytes
        self.dir = Path(root) / f"v{FORMAT_VERSION}" / layout.digest()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        self._mutex = threading.Lock()
        self.repaired = 0  # journal lines or blocks dropped while opening
        self.full: str | None = None  # why the tier stopped writing (read-only from then on), or None
        self.free_space = FreeSpace(self.dir, free_margin)
        self._check_meta()
        self._data = os.open(self.dir / "blocks.dat", os.O_RDWR | os.O_CREAT, 0o644)
        self.capacity = self._capacity_within_margin(max(0, capacity))
        self.records = self._replay()
        self._journal = os.open(self.dir / "index.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # Dropped without close(): the files are still synced and the folder's lock released.
        self._finalizer = weakref.finalize(self, _release, [self._journal, self._data], self._lock_fd)
        self._free = [s for s in range(self.capacity) if s not in self.records]
        heapq.heapify(self._free)
        self._in_use = set(self.records)

    # --- opening -------------------------------------------------------------------
    def _capacity_within_margin(self, capacity: int) -> int:
        """``capacity``, or fewer slots: those the file has and those the free margin leaves room for."""
        held = os.fstat(self._data).st_size // self.nbytes
        room = max(0, self.free_space.room()) // self.nbytes
        return min(capacity, held + room)

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
        try:
            tmp.write_text(json.dumps(expected, indent=1))
            os.replace(tmp, meta)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _replay(self) -> dict[int, DiskRecord]:
        path = self.dir / "index.log"
        path.with_suffix(".tmp").unlink(missing_ok=True)  # a rewrite that never finished
        raw = path.read_bytes() if path.exists() else b""
        lines = raw.split(b"\n")
        dropped = 1 if lines.pop() else 0  # bytes after the last newline: a torn line
        records: dict[int, DiskRecord] = {}
        sound = 0  # bytes of the journal's sound lines, from its start
        for i, line in enumerate(lines):
            parsed = _parse(line)
            if parsed is None:
                dropped += len(lines) - i
                break
            sound += len(line) + 1
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
        if dropped or len(lines) != len(fits):  # a compact journal is left as it is: opening needs no space
            self._rewrite(path, fits, sound)
        return fits

    def _rewrite(self, path: Path, records: dict[int, DiskRecord], sound: int) -> None:
        """Replace the journal with one line per record. When that fails (a full disk), keep the old
        one cut after its ``sound`` bytes, so appends start on a line of their own, and stop writing."""
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.writelines(_record_line(s, r) for s, r in sorted(records.items()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            if path.exists() and path.stat().st_size > sound:
                os.truncate(path, sound)
            self.full = f"the journal could not be compacted: {error}"
            log.warning("cannot compact the KV cache journal %s (%s): the old one is kept and the disk tier "
                        "only reads this time", path, error)

    # --- slots (manager thread) ------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self._in_use)

    @property
    def writable(self) -> bool:
        """False once the tier stopped writing (a full disk): it still reads what it holds."""
        return self.full is None

    def reserve(self) -> int | None:
        if self.full is not None:
            return None
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
                try:
                    self._append(_line(f"D {slot}"))
                except OSError as error:
                    # The block's line stays: its bytes are never overwritten (the tier stops writing),
                    # so a later process finds a block that still checks out.
                    self._stop(error)
        self._in_use.discard(slot)
        if slot < self.capacity:
            heapq.heappush(self._free, slot)

    def _stop(self, error: OSError) -> None:
        if self.full is None:
            self.full = str(error)

    # --- bytes (spill worker) --------------------------------------------------------
    def write(self, slot: int, key: bytes, valid: int, aliases: tuple[tuple[bytes, int], ...], payload) -> None:
        """Store one block's bytes, then its journal line. A full disk (ENOSPC, EDQUOT, or the free
        margin reached) raises OSError and turns the tier read-only."""
        try:
            if self.full is not None:
                raise DiskFullError(f"the KV cache in {self.dir} stopped writing: {self.full}")
            if (slot + 1) * self.nbytes > os.fstat(self._data).st_size:  # the file grows
                self.free_space.require(self.nbytes)
            self._write_bytes(slot, payload)
            record = DiskRecord(key, valid, block_crc(key, payload), tuple(aliases))
            with self._mutex:
                self._append(_record_line(slot, record))
                self.records[slot] = record
        except OSError as error:
            if error.errno in FULL_ERRNOS:
                self._stop(error)
            raise

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

    def verify(self, slot: int) -> str | None:
        """Why the block in ``slot`` cannot be used, or None when it checks out (nothing changes)."""
        with self._mutex:
            record = self.records.get(slot)
        if record is None:
            return f"slot {slot} holds no block"
        try:
            self.read(slot, record.key)
        except (ChecksumError, OSError) as error:
            return str(error)
        return None

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
