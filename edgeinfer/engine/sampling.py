"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgeinfer.errors import RequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's own EOS ids
    ignore_eos: bool = False
    max_thinking_tokens: int | None = None  # None: thinking spans are not capped

    def __post_init__(self) -> None:
        checks = [
            (self.max_thinking_tokens is None or self.max_thinking_tokens >= 0,
             f"max_thinking_tokens must be >= 0, got {self.max_thinking_tokens}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class Thinking:
    """A sequence's thinking spans (reasoning variants: ``<think> ... </think>`` before the answer),
    told apart by the family's start and end token ids, under an optional cap.

    Once ``limit`` tokens were thought inside the open span, :meth:`forced` says the next token
    must be the end token: the runtime closes the span and the answer follows. A prompt that
    ends inside a span (a Thinking template's generation prompt) starts ``open``.
    """

    start_id: int
    end_id: int
    limit: int | None = None
    open: bool = False
    spent: int = 0  # tokens thought so far, over all spans, markers not counted
    reasoning_ids: list[int] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)

    def forced(self) -> int | None:
        """The token the next step must choose: the end of thinking once the cap is spent, else None."""
        return self.end_id if self.open and self.limit is not None and self.spent >= self.limit else None

    def accept(self, token: int) -> None:
        if self.open:
            if token == self.end_id:
                self.open = False
            else:
                self.spent += 1
                self.reasoning_ids.append(token)
        elif token == self.start_id:
            self.open = True
        else:
            self.answer_ids.append(token)


def open_at_end(token_ids: list[int], start_id: int, end_id: int) -> bool:
    """Whether ``token_ids`` end inside a thinking span: its last start comes after its last end."""
    last = {start_id: -1, end_id: -1}
    for i, token in enumerate(token_ids):
        if token in last:
            last[token] = i
    return last[start_id] > last[end_id]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, then top-k and top-p, on
    whatever device ``logits`` [vocab] (float32) are on."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > params.top_p  # keep the token that crosses top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` with the request's generator, on the CPU: the random numbers
    of a seed are then the same whatever device computed the distribution."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
