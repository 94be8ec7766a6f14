"""Block keys of the prefix cache: chained hashes of token ids and of the images they cover.

A full block's key is ``H(parent key, token ids, image runs)``; the first block's parent
is the model fingerprint, so keys of two models never meet. An image run names the
content hash of the image whose placeholder tokens sit in the block and the ordinal of
its first token there: two different images behind identical placeholder tokens give
different keys.

A *partial* key covers the first ``j < block_size`` tokens of a block (an image that ends
inside a block, or the last, unfilled block of a finished request); a request may copy
such a block and write its own tokens after the first ``j``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

BlockKey = bytes  # 16 bytes
KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Image ``image_hash`` covers prompt tokens ``start .. end-1``, from its token ``ordinal`` on.

    An image whose placeholder is split by row or tile markers has several spans.
    """

    start: int
    end: int
    image_hash: str
    ordinal: int = 0


def image_spans(token_ids: Sequence[int], image_token_id: int,
                images: Sequence[tuple[str, int]]) -> tuple[ImageSpan, ...]:
    """Runs of each image's tokens: ``images`` is (content hash, token count) in prompt order."""
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    spans: list[ImageSpan] = []
    taken = 0
    for image_hash, count in images:
        mine = positions[taken:taken + count]
        taken += count
        first = 0
        for j in range(1, len(mine) + 1):
            if j == len(mine) or mine[j] != mine[j - 1] + 1:
                spans.append(ImageSpan(mine[first], mine[j - 1] + 1, image_hash, first))
                first = j
    return tuple(spans)


def _digest(*parts: bytes) -> BlockKey:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def _runs(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The image runs of tokens ``start..end-1`` as bytes: offset, ordinal and hash of each."""
    out = bytearray()
    for span in spans:
        lo, hi = max(span.start, start), min(span.end, end)
        if lo < hi:
            out += f"{lo - start}:{span.ordinal + lo - span.start}:{span.image_hash};".encode()
    return bytes(out)


def _tokens(ids: Sequence[int]) -> bytes:
    return array("q", ids).tobytes()


def full_key(parent: BlockKey, ids: Sequence[int], spans: Sequence[ImageSpan], start: int) -> BlockKey:
    """Key of the full block of tokens ``ids`` starting at prompt position ``start``."""
    return _digest(b"F", parent, _tokens(ids), _runs(spans, start, start + len(ids)))


def partial_key(parent: BlockKey, ids: Sequence[int], spans: Sequence[ImageSpan], start: int) -> BlockKey:
    """Key of the first ``len(ids)`` tokens of a block starting at ``start``."""
    return _digest(b"P", parent, _tokens(ids), _runs(spans, start, start + len(ids)))


def chain(root: BlockKey, ids: Sequence[int], spans: Sequence[ImageSpan], block_size: int,
          first: int = 0, parent: BlockKey | None = None) -> list[BlockKey]:
    """Keys of the full blocks ``first, first+1, ...`` of ``ids`` (``parent``: key of block ``first-1``)."""
    keys: list[BlockKey] = []
    parent = root if parent is None else parent
    for b in range(first, len(ids) // block_size):
        start = b * block_size
        parent = full_key(parent, ids[start:start + block_size], spans, start)
        keys.append(parent)
    return keys


def image_ends_in(spans: Sequence[ImageSpan], start: int, end: int) -> list[int]:
    """Lengths ``j`` (0 < j < end-start) at which an image run ends inside ``start..end-1``."""
    return sorted({s.end - start for s in spans if start < s.end < end})


def fingerprint(files: Iterable[Path], extra: str = "", samples: int = 64, sample_bytes: int = 4096) -> BlockKey:
    """A model fingerprint: the bytes of small files, and size plus evenly spread samples of large ones.

    Sampling keeps this to milliseconds on multi-GiB weights while telling apart two
    checkpoints that share a config but not their weights.
    """
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(extra.encode())
    for path in sorted(Path(p) for p in files):
        size = path.stat().st_size
        h.update(f"{path.name}:{size};".encode())
        with path.open("rb") as f:
            if size <= samples * sample_bytes:
                h.update(f.read())
                continue
            for i in range(samples):
                f.seek((size - sample_bytes) * i // (samples - 1))
                h.update(f.read(sample_bytes))
    return h.digest()
