"""The engine contract every backend implements, its optional abilities, and the bundle a
backend opens (:class:`Engines`). Which backend runs is chosen in :mod:`edgeinfer.backends.registry`."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import torch


class DecoderEngine(Protocol):
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[N] token ids -> [N, hidden] embeddings."""

    def step(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step: logits [B, vocab] of the last position, new_k/new_v [layers, B, T, kvh, hd].

        Families whose images attend to themselves both ways (``DecoderConfig.bidirectional_images``)
        also get ``image_groups=`` [B, T] (each new token's image run, -1 for text) where a
        prefill chunk holds image tokens; an engine for such a family takes that keyword."""


class VisionEngine(Protocol):
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processed tensors -> [num_image_tokens, text_hidden] embeddings."""


class BurstIds(Protocol):
    def rows(self) -> list[list[int]]:
        """[B][steps] chosen ids, waiting for the device where they are not read yet."""


class SamplingStep(Protocol):
    """A batch's sampler inputs held on the device (static buffers a captured step reads)."""

    def load(self, rows: BurstSampling) -> None:
        """Copy ``rows`` into the first rows of these buffers, the rest neutral (greedy)."""

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] next ids for ``logits`` [B, vocab], changing nothing."""

    def next_ids(self, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """:meth:`choose`, then the valid rows' (``valid`` [B] 0/1) counters move on. Tensor ops
        only: no host sync, no data-dependent shape."""


class BurstSampling(Protocol):
    """The rows' sampling, passed down by the engine (a backend never imports the engine)."""

    @property
    def kind(self) -> Hashable:
        """Which parts of the sampler these rows need: steps of different kinds are captured apart."""

    def static(self, batch: int, vocab: int, device: torch.device) -> SamplingStep:
        """Neutral buffers of this kind for a bucket of ``batch`` rows."""


class BurstDecoder(Protocol):
    """A decoder engine that replays decode steps on the device between trips to the host."""

    def decode_burst(self, tokens: torch.Tensor, position_ids: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     steps: int, sampling: BurstSampling | None = None) -> BurstIds | None:
        """``steps`` steps from the last token of each row, each choosing its ids with
        ``sampling`` on the device (None: every row greedy, the argmax); None where it cannot run them."""

    def continue_burst(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                       steps: int) -> BurstIds | None:
        """The next ``steps`` of the rows of the last burst, queued before its ids are read."""


class CompilableVision(Protocol):
    """A vision engine that can be readied (compiled or captured) for given inputs at load."""

    def compile_for(self, inputs: list[dict[str, torch.Tensor]]) -> None:
        """Ready the tower for these processed pictures; raises where the compiler fails."""

    def release_captures(self) -> int:
        """Drop the captured graphs (they hold the weights' addresses), keeping compiled code;
        ``compile_for`` captures again. Returns how many were dropped."""


class CapturedGraphs(Protocol):
    """A decoder engine whose captured graphs hold the KV pools' and the weights' addresses, beside
    work that depends on neither (compiled layers, tuned kernels) and outlives a sleep."""

    def release_captures(self) -> int:
        """Drop every captured graph and its memory, keeping compiled code and tuned choices;
        returns how many were dropped."""

    def recapture(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> int:
        """Capture the graphs ``release_captures`` dropped again, over these pools; returns how many."""

    def capture_state(self) -> dict[str, int]:
        """Counts of what the engine captured and tuned so far (for benchmarks)."""


class RunSettings(Protocol):
    """What a backend reads of the engine's configuration (``edgeinfer.engine.EngineConfig``),
    passed down as a value: the backends never import the engine."""

    device: str
    dtype: str
    threads: int | None
    profile_name: str
    block_size: int
    num_blocks: int | None
    kv_budget_mb: int
    max_batch_size: int
    max_context: int
    cuda_graphs: bool
    fused_decode: bool
    step_tuning_s: float
    prefill_graphs: int
    unified_memory: bool

    @property
    def torch_dtype(self) -> torch.dtype: ...


@dataclass(frozen=True, slots=True)
class Engines:
    """What a backend opened for one model: the two engines of the contract and the optional
    abilities they offer, declared here rather than probed.

    ``bursts`` is the decoder itself where it can burst, ``compiler`` the vision engine
    where it can be readied for picture sizes, ``graphs`` the decoder where it captures graphs
    (dropped at a sleep, captured again at the wake). ``backend`` and ``precision`` say what runs
    (reported with every result); ``build_identity`` ties prefix-cache entries to the build.
    ``passed_over`` names the built engines the choice did not use because they are stale,
    each with the command that rebuilds them.
    """

    decoder: DecoderEngine
    vision: VisionEngine
    backend: str
    precision: str
    bursts: BurstDecoder | None = None
    compiler: CompilableVision | None = None
    graphs: CapturedGraphs | None = None
    build_identity: str = ""
    passed_over: tuple[str, ...] = ()
