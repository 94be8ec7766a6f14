"""The vision engine's outputs on disk, by image content hash.

A second question about the same frame, even after a restart, skips the vision encoder.
The files live in the ``vision/`` folder of the KV disk tier's cache folder (so they share
its lock and its model fingerprint); each file is written whole, then renamed. A file is
``MAGIC``, one line of JSON (``key``, ``owner``, ``dtype``, ``shape``, ``crc``), then the
raw values. The checksum covers the values *and* the key and owner the file was written
for, so a file copied over another image's file, or from another model's folder, fails it
like a damaged one: any file that does not check out is deleted with a warning and the
image encoded again; it is never used and never an error of the request. Writes run in
the background on the spill worker, after the step that computed the embeddings, and
stop (one warning) when the filesystem is left with less than its free margin.

Any object with ``load(key)`` and ``store(key, embeds)`` serves as a vision cache's
persistent store; :class:`EmbeddingStore` is the one this package provides. ``keys()``
and ``verify(key)`` let a maintenance command check every file without loading a model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from edgeinfer.kv.disk import FULL_ERRNOS, FreeSpace
from edgeinfer.kv.worker import Job, SpillWorker, to_host

log = logging.getLogger(__name__)

# The dtypes a vision engine hands out; a header naming anything else is damage.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                  "bfloat16": torch.bfloat16, "float64": torch.float64}


class DamagedEntry(ValueError):
    """A stored file that cannot be used; the message says why."""


def _crc(owner: str, key: str, dtype: str, shape: list[int], body: bytes) -> int:
    bound = json.dumps([owner, key, dtype, shape]).encode()
    return zlib.crc32(body, zlib.crc32(bound))


def _shape(value: object) -> list[int]:
    if not isinstance(value, list) or not 1 <= len(value) <= 4 or not all(
            type(n) is int and n > 0 for n in value):
        raise DamagedEntry(f"shape {str(value)[:40]} is not a list of 1 to 4 positive integers")
    return value


def decode_entry(raw: bytes, key: str, owner: str) -> torch.Tensor:
    """The embeddings in a file's bytes, checked against the ``key`` and ``owner`` they must be
    for; raises :class:`DamagedEntry` naming the first thing wrong."""
    if not raw.startswith(EmbeddingStore.MAGIC):
        raise DamagedEntry("not a vision cache file of this version")
    head, newline, body = raw[len(EmbeddingStore.MAGIC):].partition(b"\n")
    if not newline:
        raise DamagedEntry("header cut short")
    try:
        meta = json.loads(head)
    except ValueError as error:  # UnicodeDecodeError is a ValueError too
        raise DamagedEntry(f"header is not JSON ({error})") from None
    if not isinstance(meta, dict):
        raise DamagedEntry(f"header is a JSON {type(meta).__name__}, not an object")
    dtype_name, crc = meta.get("dtype"), meta.get("crc")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise DamagedEntry(f"dtype {str(dtype_name)[:40]} is not one of {', '.join(DTYPES)}")
    if type(crc) is not int:
        raise DamagedEntry("checksum is not an integer")
    shape, dtype = _shape(meta.get("shape")), DTYPES[dtype_name]
    if meta.get("key") != key or meta.get("owner") != owner:
        raise DamagedEntry("written for another image or another model")
    if len(body) != math.prod(shape) * dtype.itemsize:
        raise DamagedEntry(f"{len(body)} bytes of values, {math.prod(shape) * dtype.itemsize} expected")
    if _crc(owner, key, dtype_name, shape, body) != crc:
        raise DamagedEntry("checksum does not match")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).view(shape)


def encode_entry(key: str, owner: str, embeds: torch.Tensor) -> bytes:
    """The bytes of a file holding ``embeds`` for ``key`` (and ``owner``)."""
    x = to_host(embeds.detach().contiguous())
    dtype_name = str(x.dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ValueError(f"embeddings of dtype {dtype_name} cannot be stored")
    body = x.view(-1).view(torch.uint8).numpy().tobytes()
    shape = list(x.shape)
    head = {"key": key, "owner": owner, "dtype": dtype_name, "shape": shape,
            "crc": _crc(owner, key, dtype_name, shape, body)}
    return EmbeddingStore.MAGIC + json.dumps(head).encode() + b"\n" + body


class EmbeddingStore:
    """Embeddings by key (an image content hash); at most ``max_files`` files, the oldest pruned.

    ``owner`` names what the embeddings come from (the model fingerprint): a file written
    for another owner is never used.
    """

    MAGIC = b"EIEMB2\n"

    def __init__(self, folder: Path, worker: SpillWorker | None = None, max_files: int = 1024, *,
                 owner: str = "", free_space: FreeSpace | None = None) -> None:
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_files = max_files
        self.owner = owner
        self._worker = worker  # None: ``store`` writes at once, on the caller's thread
        self._free_space = free_space or FreeSpace(self.dir)
        self._warned = False
        self.stopped = False  # the filesystem is full (or at its margin): no more writes

    def load(self, key: str) -> torch.Tensor | None:
        """The stored embeddings, or None when there are none (or the file was damaged, or written
        for another key or owner: it is deleted, with a warning)."""
        path = self._path(key)
        try:
            return decode_entry(path.read_bytes(), key, self.owner)
        except FileNotFoundError:
            return None
        except (OSError, DamagedEntry) as error:
            log.warning("vision cache file %s cannot be used (%s); it is deleted and the image encoded again",
                        path, error)
            self.discard(key)
            return None

    def verify(self, key: str) -> str | None:
        """Why the file stored under ``key`` cannot be used, or None when it can (nothing changes)."""
        try:
            decode_entry(self._path(key).read_bytes(), key, self.owner)
        except (OSError, DamagedEntry) as error:
            return str(error)
        return None

    def keys(self) -> Iterator[str]:
        """The keys that have a file (sound or not)."""
        return (path.stem for path in self.dir.glob("*.emb"))

    def discard(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError:
            pass  # a folder we cannot write: the file fails again next time, and is not used

    def store(self, key: str, embeds: torch.Tensor) -> None:
        """Write ``embeds`` under ``key`` (in the background when the store has a worker); a failed
        write is one warning, never an error of the request."""
        if self.stopped:
            return
        if self._worker is None:
            self._write_or_warn(key, embeds)
            return
        self._worker.submit(Job(lambda: self._write_or_warn(key, embeds), urgent=False,
                                after=self._worker.compute_event()))

    def write(self, key: str, embeds: torch.Tensor) -> None:
        """Write ``embeds`` under ``key`` now; raises OSError when the folder cannot take it (a
        :class:`DiskFullError` when it would leave the filesystem under its free margin)."""
        data = encode_entry(key, self.owner, embeds)
        self._free_space.require(len(data))
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self._path(key))
        except BaseException:
            tmp.unlink(missing_ok=True)  # no half-written file left behind
            raise
        self._prune()

    def _write_or_warn(self, key: str, embeds: torch.Tensor) -> None:
        try:
            self.write(key, embeds)
        except OSError as error:
            self.stopped = self.stopped or error.errno in FULL_ERRNOS
            if not self._warned:
                self._warned = True
                then = "it stops writing and keeps reading" if self.stopped else "the image stays in memory only"
                log.warning("cannot write the vision cache to %s: %s; %s", self.dir, error, then)

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.emb"

    def _prune(self) -> None:
        files = list(self.dir.glob("*.emb"))
        if len(files) <= self.max_files:
            return
        files.sort(key=lambda p: p.stat().st_mtime)
        for path in files[:len(files) - self.max_files]:
            path.unlink(missing_ok=True)
