"""A request's sequence: its prompt, its generated tokens, its blocks and its state."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from edgeinfer.engine.sampling import SamplingParams, Thinking
from edgeinfer.kv.hashing import ImageSpan
from edgeinfer.kv.pool import BlockTable

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_new_tokens
    CANCELLED = "cancelled"


@dataclass
class Timings:
    created: float = field(default_factory=time.perf_counter)
    wake_s: float = 0.0  # waking the engine from sleep for this request
    wake_capture_s: float = 0.0  # of which capturing the engines' graphs again
    vision_s: float = 0.0
    prefill_s: float = 0.0
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.created

    def decode_tokens_per_s(self, generated: int) -> float | None:
        if self.first_token is None or self.finished is None or generated < 2:
            return None
        return (generated - 1) / max(self.finished - self.first_token, 1e-9)


@dataclass(eq=False)
class Sequence:
    """Tokens 0..prompt_len-1 are the prompt (embeddings given); later ones were generated.

    ``num_cached`` tokens have K/V in the pool. While running, the last generated token
    is not yet cached: it is the next decode step's input.
    """

    prompt_ids: list[int]
    prompt_embeds: torch.Tensor  # [prompt_len, hidden], image embeddings merged
    prompt_positions: torch.Tensor  # [prompt_len] or [3, prompt_len]
    next_position: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    block_table: BlockTable
    seed: int = 0  # the request's, or one drawn at admission: keys its random numbers
    seq_id: int = field(default_factory=lambda: next(_ids))
    generated: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    timings: Timings = field(default_factory=Timings)
    image_tokens: int = 0
    image_spans: tuple[ImageSpan, ...] = ()  # which image each image token shows (prefix-cache keys)
    # [prompt_len] image run of each prompt token (-1 text) where images attend bidirectionally; else None
    image_groups: torch.Tensor | None = None
    prefix_tokens_reused: int = 0
    vision_reused: int = 0
    spilled_blocks: int = 0  # blocks moved off the device (preempted, or idle above the watermark at its end)
    restored_blocks: int = 0  # blocks brought back from the host or disk tier for it
    recomputed_blocks: int = 0  # blocks it was to reuse but recomputes (a failed checksum or read)
    thinking: Thinking | None = None  # None: the family has no thinking tokens
    # Where the prompt's embeddings were made on a stream of their own (pictures are encoded beside
    # the decode steps): the CUDA event they are ready at, which a prompt chunk waits for; else None
    embeds_ready: torch.cuda.Event | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.generated)

    @property
    def num_cached(self) -> int:
        return self.block_table.num_tokens

    @property
    def prefill_target(self) -> int:
        """Tokens that must be cached before decoding can go on."""
        return self.prompt_len if not self.generated else self.num_tokens - 1

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_target

    def position(self, index: int) -> torch.Tensor:
        """Position id(s) of token ``index`` as a [1] or [3, 1] tensor."""
        if index < self.prompt_len:
            return self.prompt_positions[..., index:index + 1]
        value = self.next_position + index - self.prompt_len
        shape = (3, 1) if self.prompt_positions.dim() == 2 else (1,)
        return torch.full(shape, value, dtype=torch.long)

    def attend_groups(self, start: int, end: int) -> torch.Tensor | None:
        """[end - start] image run of tokens ``start .. end-1`` (-1 text), where the family's
        images attend to themselves in both directions and the span holds image tokens; else None."""
        if self.image_groups is None or start >= self.prompt_len:
            return None
        groups = self.image_groups[start:min(end, self.prompt_len)]
        if not bool((groups >= 0).any()):
            return None
        return torch.cat((groups, torch.full((end - start - groups.shape[0],), -1, dtype=groups.dtype)))

    def chunk_end(self, end: int) -> int:
        """``end``, moved past the image run it would cut where images attend both ways: a
        chunk ending inside an image would hide the image's later tokens from its earlier ones."""
        groups = self.image_groups
        if groups is None or not 0 < end < self.prompt_len:
            return end
        run = int(groups[end - 1])
        if run < 0 or int(groups[end]) != run:
            return end
        return end + int((groups[end:] == run).sum())  # a run is contiguous

    def positions(self, start: int, end: int) -> torch.Tensor:
        if end <= self.prompt_len:
            return self.prompt_positions[..., start:end]
        return torch.cat([self.position(i) for i in range(start, end)], dim=-1)
