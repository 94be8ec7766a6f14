"""Image embeddings by image content hash: a second question about the same picture skips
the vision engine.

Two levels: an in-memory LRU of ``entries`` embeddings on the engine's device, over a lower
store (the disk tier where the profile has one, else none) that keeps them across restarts. A miss in
both runs the vision engine and stores the result in both. The lower store answers only
what it can vouch for (its files are checked against their key); embeddings it gives that
still do not fit the image (another token count) are a warning and a recompute, never an
error of the request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

import torch

from edgeinfer.backends.base import VisionEngine
from edgeinfer.errors import RequestError
from edgeinfer.models.base import ImageInputs

log = logging.getLogger(__name__)


class EmbeddingStore(Protocol):
    """Where embeddings the memory level dropped can still be found."""

    def load(self, key: str) -> torch.Tensor | None:
        """The embeddings stored under ``key``, or None."""

    def store(self, key: str, embeds: torch.Tensor) -> None:
        """Keep ``embeds`` under ``key`` (a store may decline, e.g. with no room)."""


class VisionCache:
    def __init__(self, vision: VisionEngine, lower: EmbeddingStore | None, entries: int, device: str) -> None:
        self.vision = vision
        self.lower = lower
        self.entries = entries
        self.device = device
        self._memory: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.runs = 0  # vision engine runs
        self.reused = 0  # images answered from either level

    def embeddings(self, key: str, image: ImageInputs) -> tuple[torch.Tensor, bool]:
        """``image``'s embeddings, and whether they were reused rather than computed."""
        embeds, reused = self._memory.get(key), True
        if embeds is not None:
            self._memory.move_to_end(key)
        else:
            embeds, reused = self._from_lower_or_run(key, image)
            self._remember(key, embeds)
        self.reused += reused
        if embeds.shape[0] != image.num_tokens:
            raise RequestError(f"vision engine gave {embeds.shape[0]} embeddings for {image.num_tokens} tokens")
        return embeds, reused

    def clear(self) -> None:
        """Forget the memory level (the lower store keeps its entries): the next question about
        a picture loads or recomputes its embeddings."""
        self._memory.clear()

    def _from_lower_or_run(self, key: str, image: ImageInputs) -> tuple[torch.Tensor, bool]:
        stored = None if self.lower is None else self.lower.load(key)
        if stored is not None and stored.dim() == 2 and stored.shape[0] == image.num_tokens:
            return stored.to(self.device), True
        if stored is not None:
            log.warning("stored embeddings for image %s have shape %s, the image needs %d tokens; "
                        "it is encoded again", key[:16], tuple(stored.shape), image.num_tokens)
        embeds = self.vision.encode(image.tensors)
        self.runs += 1
        if self.lower is not None:
            self.lower.store(key, embeds)
        return embeds, False

    def _remember(self, key: str, embeds: torch.Tensor) -> None:
        self._memory[key] = embeds
        while len(self._memory) > self.entries:
            self._memory.popitem(last=False)
