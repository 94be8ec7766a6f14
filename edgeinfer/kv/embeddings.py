"""The vision engine's outputs on disk, by image content hash.

A second question about the same frame, even after a restart, skips the vision encoder.
The files live in the ``vision/`` folder of the KV disk tier's cache folder (so they share
its lock and its model fingerprint); each file is written whole, then renamed, and carries
a checksum: a damaged file is deleted and the image encoded again. Writes run in the
background on the spill worker, after the step that computed the embeddings.

Any object with ``load(key)`` and ``store(key, embeds)`` serves as a vision cache's
persistent store; :class:`EmbeddingStore` is the one this package provides.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

import torch

from edgeinfer.kv.worker import Job, SpillWorker

log = logging.getLogger(__name__)


class EmbeddingStore:
    """Embeddings by key (an image content hash); at most ``max_files`` files, the oldest pruned."""

    MAGIC = b"EIEMB1\n"

    def __init__(self, folder: Path, worker: SpillWorker | None = None, max_files: int = 1024) -> None:
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_files = max_files
        self._worker = worker  # None: ``store`` writes at once, on the caller's thread
        self._warned = False

    def load(self, key: str) -> torch.Tensor | None:
        """The stored embeddings, or None when there are none (or the file was damaged: it is deleted)."""
        path = self._path(key)
        try:
            raw = path.read_bytes()
            if not raw.startswith(self.MAGIC):
                raise ValueError("bad magic")
            head, _, body = raw[len(self.MAGIC):].partition(b"\n")
            meta = json.loads(head)
            if zlib.crc32(body) != meta["crc"]:
                raise ValueError("checksum")
            dtype = getattr(torch, meta["dtype"])
            return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).view(meta["shape"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, AttributeError, RuntimeError):
            log.warning("vision cache file %s is damaged; it is deleted and the image encoded again", path)
            path.unlink(missing_ok=True)
            return None

    def store(self, key: str, embeds: torch.Tensor) -> None:
        """Write ``embeds`` under ``key`` (in the background when the store has a worker); a failed
        write is one warning, never an error of the request."""
        if self._worker is None:
            self._write_or_warn(key, embeds)
            return
        self._worker.submit(Job(lambda: self._write_or_warn(key, embeds), urgent=False,
                                after=self._worker.compute_event()))

    def write(self, key: str, embeds: torch.Tensor) -> None:
        """Write ``embeds`` under ``key`` now; raises OSError when the folder cannot take it."""
        x = embeds.detach().contiguous().cpu()
        body = x.view(-1).view(torch.uint8).numpy().tobytes()
        head = json.dumps({"dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape),
                           "crc": zlib.crc32(body)}).encode() + b"\n"
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(self.MAGIC + head + body)
        os.replace(tmp, self._path(key))
        self._prune()

    def _write_or_warn(self, key: str, embeds: torch.Tensor) -> None:
        try:
            self.write(key, embeds)
        except OSError as error:
            if not self._warned:
                self._warned = True
                log.warning("cannot write the vision cache to %s: %s", self.dir, error)

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.emb"

    def _prune(self) -> None:
        files = list(self.dir.glob("*.emb"))
        if len(files) <= self.max_files:
            return
        files.sort(key=lambda p: p.stat().st_mtime)
        for path in files[:len(files) - self.max_files]:
            path.unlink(missing_ok=True)
