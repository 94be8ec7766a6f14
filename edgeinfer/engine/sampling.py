"""Sampling parameters and the sampler: greedy, penalties, temperature, top-k, min-p, top-p, seeded.

The sampler is torch tensor ops on whatever device the logits are on, with per-row
parameters as tensors: one call serves a batch that mixes greedy rows (temperature 0,
exactly the argmax) and sampled rows. Nothing in it reads a value back to the host or
makes a shape depend on data, so it also runs inside a captured CUDA graph, several decode
steps at a time (:class:`SamplingState` is what such a graph holds).

A row's next token, in order:

1. penalties (only in batches where some row asks for one): ``repetition_penalty`` divides
   a positive logit (multiplies a negative one) of every token the row has seen, prompt or
   generated; then ``frequency_penalty`` times the token's count in the generated text, and
   ``presence_penalty`` where that count is above 0, are subtracted (the OpenAI API's
   definitions). Greedy rows take the argmax of these logits;
2. temperature divides the logits; top-k keeps the ``top_k`` largest; min-p keeps the
   tokens whose probability is at least ``min_p`` times the most likely one's; top-p keeps
   the most likely tokens up to and including the one that brings their mass to ``top_p``
   (of the distribution left by top-k and min-p);
3. the draw: inverse CDF over the kept tokens sorted from most to least likely, with one
   uniform from :func:`edgeinfer.engine.sampling_rng.uniforms` keyed by the request's seed
   and the index of the token drawn.

Penalties need each row's token counts: a ``[rows, vocab]`` int32 count tensor of the
generated tokens and a ``[rows, vocab]`` bool mask of the prompt's, on the device, rebuilt
from the host's token lists when a step or burst starts and updated by the drawn ids
(``scatter_add``) inside a burst. Their memory is bounded by the batch bucket times the
vocabulary (64 rows of a 151,936-token vocabulary: 49 MB), and they exist only for batches
in which some row has a penalty.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import torch

from edgeinfer.engine.sampling_rng import as_int64, uniforms
from edgeinfer.errors import RequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 means off
    repetition_penalty: float = 1.0  # 1 means off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: one is drawn when the request is admitted
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
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (0.0 < self.repetition_penalty <= 10.0,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


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


# --- the sampler --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SamplerKind:
    """Which parts of the sampler a batch runs; part of a captured step's key."""

    draws: bool  # some row samples (otherwise every row takes the argmax)
    penalizes: bool  # some row has a penalty

    @classmethod
    def of(cls, params: Seq[SamplingParams]) -> SamplerKind:
        return cls(any(not p.greedy for p in params), any(p.penalized for p in params))


GREEDY = SamplerKind(draws=False, penalizes=False)


@dataclass(frozen=True, slots=True)
class SamplingRows:
    """B rows' sampling as the host knows it: parameters, seeds, how many tokens each row
    generated (the index of its next draw), and the tokens each row saw (read by
    :meth:`SamplingState.load` at once, only where some row penalizes)."""

    params: tuple[SamplingParams, ...]
    seeds: tuple[int, ...]
    prompts: tuple[Seq[int], ...]
    generated: tuple[Seq[int], ...]

    @property
    def kind(self) -> SamplerKind:
        return SamplerKind.of(self.params)

    def static(self, batch: int, vocab: int, device: torch.device | str) -> SamplingState:
        """Neutral (greedy) buffers for ``batch`` rows of this kind, to :meth:`SamplingState.load` into."""
        return SamplingState.neutral(batch, vocab, device, self.kind)

    def state(self, vocab: int, device: torch.device | str) -> SamplingState:
        state = self.static(len(self.params), vocab, device)
        state.load(self)
        return state


_KNOBS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_NEUTRAL = SamplingParams()


@dataclass(slots=True)
class SamplingState:
    """The sampler's inputs on the device for a batch of ``B`` rows, padding rows greedy.

    ``knobs`` [6, B] float32: temperature, top_p, min_p, repetition, frequency and presence
    penalties; ``ints`` [3, B] int64: top_k, seed (as int64), counter (tokens generated: the
    index of the next draw); ``counts`` [B, vocab] int32 of generated tokens and
    ``prompt_seen`` [B, vocab] bool, only for a kind that penalizes. A captured step reads
    these buffers; :meth:`load` refills them in place and :meth:`next_ids` moves them on.
    """

    kind: SamplerKind
    knobs: torch.Tensor
    ints: torch.Tensor
    counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None

    @classmethod
    def neutral(cls, batch: int, vocab: int, device: torch.device | str, kind: SamplerKind) -> SamplingState:
        knobs = torch.tensor([float(getattr(_NEUTRAL, k)) for k in _KNOBS])[:, None].repeat(1, batch).to(device)
        ints = torch.zeros(3, batch, dtype=torch.long, device=device)
        if not kind.penalizes:
            return cls(kind, knobs, ints)
        return cls(kind, knobs, ints, torch.zeros(batch, vocab, dtype=torch.int32, device=device),
                   torch.zeros(batch, vocab, dtype=torch.bool, device=device))

    @property
    def temperature(self) -> torch.Tensor:
        return self.knobs[0]

    @property
    def counters(self) -> torch.Tensor:
        return self.ints[2]

    def load(self, rows: SamplingRows) -> None:
        """``rows`` into the first rows of these buffers, the rest neutral; the counts rebuilt
        from the rows' token lists. Copies only: no wait for the device."""
        b, batch = len(rows.params), self.knobs.shape[1]
        needs = rows.kind
        if b > batch or (needs.draws and not self.kind.draws) or (needs.penalizes and not self.kind.penalizes):
            raise ValueError(f"{b} rows of {needs} do not fit buffers of {batch} rows of {self.kind}")
        params = [replace(p, temperature=0.0) if p.greedy else p for p in rows.params] + [_NEUTRAL] * (batch - b)
        knobs = torch.tensor([[float(getattr(p, k)) for p in params] for k in _KNOBS], dtype=torch.float32)
        top_k = [p.top_k for p in params]
        seeds = [as_int64(s) for s in rows.seeds] + [0] * (batch - b)
        counters = [len(g) for g in rows.generated] + [0] * (batch - b)
        device = self.knobs.device
        self.knobs.copy_(knobs.to(device, non_blocking=True))
        self.ints.copy_(torch.tensor([top_k, seeds, counters], dtype=torch.long).to(device, non_blocking=True))
        if self.counts is not None:
            self.counts.zero_()
            self.prompt_seen.zero_()
            rows_of, tokens = _flat(rows.generated)
            self.counts.index_put_((rows_of.to(device), tokens.to(device)),
                                   torch.ones(len(tokens), dtype=torch.int32, device=device), accumulate=True)
            rows_of, tokens = _flat(rows.prompts)
            self.prompt_seen[rows_of.to(device), tokens.to(device)] = True

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] next ids for float32 ``logits`` [B, vocab]: the argmax for greedy rows, a draw for the others."""
        logits = penalized(logits, self) if self.kind.penalizes else logits
        greedy = logits.argmax(-1)
        if not self.kind.draws:
            return greedy
        weights, order, cdf = filtered_sorted(logits, self)
        drawn = draw_sorted(weights, order, cdf, uniforms(self.ints[1], self.counters))
        return torch.where(self.temperature > 0, drawn, greedy)

    def advance(self, ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Each valid row (``valid`` [B] 0/1 int64) drew ``ids``: its counter and counts move on."""
        self.counters.add_(valid)
        if self.counts is not None:
            self.counts.scatter_add_(1, ids[:, None], valid[:, None].to(torch.int32))

    def next_ids(self, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """:meth:`choose`, then :meth:`advance`: one step of a burst."""
        ids = self.choose(logits)
        self.advance(ids, valid)
        return ids


def _flat(token_lists: Seq[Seq[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs of every token of every row, as two int64 tensors on the host."""
    rows = [i for i, tokens in enumerate(token_lists) for _ in tokens]
    return torch.tensor(rows, dtype=torch.long), torch.tensor([t for tokens in token_lists for t in tokens],
                                                              dtype=torch.long)


def penalized(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """``logits`` [B, vocab] after the rows' repetition, frequency and presence penalties."""
    _, _, _, repetition, frequency, presence = (k[:, None] for k in state.knobs)
    counts = state.counts.to(logits.dtype)
    present = (state.counts > 0).to(logits.dtype)
    seen = state.prompt_seen | (state.counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * present


def filtered_sorted(logits: torch.Tensor, state: SamplingState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' distributions after temperature, top-k, min-p and top-p, each sorted from most
    to least likely: (weights [B, vocab], proportional to the probabilities and zero where
    dropped, 1 for the most likely token; vocabulary ids [B, vocab]; the running sum of the
    weights [B, vocab], the CDF of the kept tokens up to the last of them).

    One sort and one running sum: a token's weight ``exp(l - l_max)`` is its probability over the
    most likely token's, which is what min-p compares, and whatever top-k and min-p keep is a
    prefix of the order, so the running sum of kept weights is the mass top-p needs, and what
    top-p keeps is a prefix of that prefix, whose CDF the same sum already is. (Two softmaxes
    over the vocabulary took longer than the sort at one row; a second running sum, 190 µs at 16
    rows on an H200, is not taken.)"""
    temperature, top_p, min_p = (k[:, None] for k in state.knobs[:3])
    vocab = logits.shape[-1]
    scaled = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    top_k = state.ints[0][:, None]
    ranks = torch.arange(vocab, device=logits.device)[None]
    weights = torch.exp(ordered - ordered[:, :1])
    keep = (ranks < torch.where(top_k > 0, top_k, vocab)) & (weights >= min_p)  # the first token is always kept
    weights = weights.masked_fill(~keep, 0.0)
    mass = weights.cumsum(-1)
    before = mass - weights  # the mass of the more likely tokens: the one that crosses top_p is kept
    keep = keep & ((before <= top_p * mass[:, -1:]) | (top_p >= 1.0))
    return weights.masked_fill(~keep, 0.0), order, mass


def draw_sorted(weights: torch.Tensor, order: torch.Tensor, cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] ids by inverse CDF: the first sorted token whose cumulative weight ``cdf`` exceeds
    ``uniform`` [B] times the kept tokens' total; never a token of zero weight."""
    last = ((weights > 0).sum(-1, keepdim=True) - 1).clamp(min=0)  # the kept tokens are a prefix of the order
    total = cdf.gather(1, last)
    index = torch.searchsorted(cdf, uniform[:, None] * total, right=True)
    return order.gather(1, torch.minimum(index, last))[:, 0]


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one sampled row draws from, in vocabulary order, for float32 ``logits``
    [vocab] (penalties are left out: they need the row's tokens)."""
    state = SamplingRows((params,), (0,), ((),), ((),)).state(logits.shape[-1], logits.device)
    weights, order, _ = filtered_sorted(logits[None], state)
    return torch.zeros_like(weights).scatter(1, order, weights / weights.sum(-1, keepdim=True))[0]
