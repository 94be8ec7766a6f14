"""The engine contract every backend implements, and the backend registry."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch

from edgeinfer.errors import BackendUnavailableError


class DecoderEngine(Protocol):
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[N] token ids -> [N, hidden] embeddings."""

    def step(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step: logits [B, vocab] of the last position, new_k/new_v [layers, B, T, kvh, hd]."""


class VisionEngine(Protocol):
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processed tensors -> [num_image_tokens, text_hidden] embeddings."""


class BurstIds(Protocol):
    def rows(self) -> list[list[int]]:
        """[B][steps] chosen ids, waiting for the device where they are not read yet."""


class BurstDecoder(Protocol):
    """A decoder engine that replays greedy steps on the device between trips to the host."""

    def decode_burst(self, tokens: torch.Tensor, position_ids: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     steps: int) -> BurstIds | None:
        """``steps`` greedy steps from the last token of each row; None where it cannot run them."""

    def continue_burst(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                       steps: int) -> BurstIds | None:
        """The next ``steps`` of the rows of the last burst, queued before its ids are read."""


class CompilableVision(Protocol):
    """A vision engine that can be readied (compiled or captured) for given inputs at load."""

    def compile_for(self, inputs: list[dict[str, torch.Tensor]]) -> None:
        """Ready the tower for these processed pictures; raises where the compiler fails."""


@dataclass(frozen=True, slots=True)
class Engines:
    """What a backend opened for one model: the two engines of the contract and the optional
    abilities they offer, declared here rather than probed.

    ``bursts`` is the decoder itself where it can burst, ``compiler`` the vision engine
    where it can be readied for picture sizes. ``backend`` and ``precision`` say what runs
    (reported with every result); ``build_identity`` ties prefix-cache entries to the build.
    """

    decoder: DecoderEngine
    vision: VisionEngine
    backend: str
    precision: str
    bursts: BurstDecoder | None = None
    compiler: CompilableVision | None = None
    build_identity: str = ""


# name -> (module that must import, why it would be missing)
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "pip install torch"),
    "onnxruntime": ("onnxruntime", "pip install onnxruntime (or onnxruntime-gpu on CUDA)"),
    "tensorrt": ("tensorrt", "install TensorRT 10.x (JetPack ships it on Jetson: sudo apt install python3-libnvinfer; "
                             "pip install 'edgeinfer[tensorrt]' elsewhere)"),
}


def resolve_backend(name: str) -> str:
    """``auto`` picks the best installed backend; a named one must be installed (no silent fallback)."""
    if name == "auto":
        return "torch"
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    module, how = BACKENDS[name]
    if importlib.util.find_spec(module) is None:
        raise BackendUnavailableError(f"backend {name!r} needs the {module!r} package, which is not installed: {how}")
    return name
