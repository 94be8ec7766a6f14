"""The model runner: one unit of the scheduler's work through the decoder engine.

A prefill chunk or a batched decode step goes through the decoder engine's ``step``; the
new K/V are written into the pool at each token's slot (the block tables say where); the
next token of each row is chosen and handed to :class:`Output`, and a row that ends is
finished in the scheduler.

Where the backend declares bursts (``Engines.bursts``), rows decode several steps on the
device between trips to the host, greedy and sampled alike (the sampler runs on the device,
its random numbers keyed by each request's seed and step), and the next burst of the same
rows is queued before the host reads the last one, so the device is not idle meanwhile.
Tokens of a burst are accepted one by one as steps would, so the scheduler's and the KV
manager's view never differs from step-by-step decoding, and a stop string is found on the
host as it would be step by step: the burst's tokens after it are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from edgeinfer.backends.base import BurstIds, Engines
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.output import Output
from edgeinfer.engine.sampling import GREEDY, SamplingRows
from edgeinfer.engine.scheduler import DecodeWork, PrefillWork, Scheduler
from edgeinfer.engine.sequence import Sequence, Status
from edgeinfer.kv.pool import KVCache
from edgeinfer.models.decoder import widen_embeds


@dataclass
class _Burst:
    """Decode steps queued on the device whose tokens the host has not read yet."""

    seqs: tuple[Sequence, ...]
    ids: BurstIds
    steps: int


def block_tables(seqs: Seq[Sequence]) -> torch.Tensor:
    """[B, widest table] block ids, shorter tables padded with block 0 (masked by context_lens)."""
    width = max(len(s.block_table.blocks) for s in seqs)
    return torch.tensor([s.block_table.blocks + [0] * (width - len(s.block_table.blocks)) for s in seqs])


def decode_inputs(seqs: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's last token id and its position, the input of the next decode step."""
    last = torch.tensor([s.generated[-1] for s in seqs])
    return last, torch.cat([s.position(s.num_tokens - 1) for s in seqs], dim=-1)[..., None]


def sampling_rows(seqs: Seq[Sequence]) -> SamplingRows:
    """The sampler's view of ``seqs``: parameters, seeds, and the tokens each one saw."""
    return SamplingRows(tuple(s.sampling for s in seqs), tuple(s.seed for s in seqs),
                        tuple(s.prompt_ids for s in seqs), tuple(s.generated for s in seqs))


def thinking_forced(seq: Sequence, token: int) -> int:
    """``token``, or the end of ``seq``'s thinking span where its thinking cap is spent."""
    forced = None if seq.thinking is None else seq.thinking.forced()
    return token if forced is None else forced


class Runner:
    def __init__(self, engines: Engines, kv: KVCache, scheduler: Scheduler, output: Output,
                 config: EngineConfig) -> None:
        self.decoder = engines.decoder
        self.bursts = engines.bursts  # None: the decoder runs step by step
        self.kv = kv
        self.scheduler = scheduler
        self.output = output
        self.burst = config.decode_burst
        self.block_size = config.block_size
        self.counters = {"prefill_tokens": 0, "decode_steps": 0, "decode_bursts": 0, "decode_bursts_ahead": 0}
        self._in_flight: _Burst | None = None  # a burst whose tokens are not read yet

    @property
    def burst_in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self, joining: int = 0) -> list[Sequence]:
        """Run one unit of work; returns the sequences that got a new token. ``joining``: requests
        that will be submitted before the next step (a server's admitted queue), so decoding runs
        step by step meanwhile, as it does while the scheduler has a sequence waiting."""
        if self._in_flight is not None:
            return self._collect_burst(joining)
        work = self.scheduler.schedule()
        if isinstance(work, PrefillWork):
            return self._run_prefill(work)
        if isinstance(work, DecodeWork):
            return self._run_decode(work, joining)
        return []

    def _run_prefill(self, work: PrefillWork) -> list[Sequence]:
        seq, start, end = work.seq, work.start, work.end
        t0 = time.perf_counter()
        embeds = self._embeds(seq, start, end)[None]
        positions = seq.positions(start, end)[..., None, :]
        groups = seq.attend_groups(start, end)
        logits = self._forward(embeds, positions, [seq], [start], None if groups is None else groups[None])
        self.counters["prefill_tokens"] += end - start
        seq.timings.prefill_s += time.perf_counter() - t0
        if not work.samples:
            return []
        self._accept(seq, self.choose_tokens([seq], logits)[0])
        return [seq]

    def _run_decode(self, work: DecodeWork, joining: int) -> list[Sequence]:
        seqs = work.seqs
        steps = self._burst_length(seqs, joining)
        if steps > 1 and (ids := self._start_burst(seqs, steps)) is not None:
            self._in_flight = _Burst(seqs, ids, steps)
            return self._collect_burst(joining)
        last, positions = decode_inputs(seqs)
        embeds = self.decoder.embed(last)[:, None]
        logits = self._forward(embeds, positions, list(seqs), [s.num_cached for s in seqs])
        self.counters["decode_steps"] += 1
        for seq, token in zip(seqs, self.choose_tokens(seqs, logits)):
            self._accept(seq, token)
        return list(seqs)

    def _embeds(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        if seq.embeds_ready is not None:  # the device waits for the picture stream, not the host
            torch.cuda.current_stream(seq.prompt_embeds.device).wait_event(seq.embeds_ready)
            seq.embeds_ready = None
        if end <= seq.prompt_len:
            return seq.prompt_embeds[start:end]
        tail = torch.tensor(seq.generated[max(0, start - seq.prompt_len):end - seq.prompt_len])
        parts = [seq.prompt_embeds[start:seq.prompt_len]] if start < seq.prompt_len else []
        width = seq.prompt_embeds.shape[-1]  # wider than the tail's where the prompt carries deepstack additions
        return torch.cat(parts + [widen_embeds(self.decoder.embed(tail), width)])

    def _forward(self, embeds, positions, seqs: list[Sequence], context: list[int],
                 image_groups: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder engine and write the new K/V at each sequence's slots. ``image_groups``
        [B,T] goes to the step only where a chunk holds images that attend both ways."""
        t = embeds.shape[1]
        extra = {} if image_groups is None else {"image_groups": image_groups}
        logits, new_k, new_v = self.decoder.step(
            embeds, positions, self.kv.k, self.kv.v, block_tables(seqs), torch.tensor(context), **extra)
        slots = torch.tensor([slot for s, c in zip(seqs, context) for slot in s.block_table.slots(c, t)])
        self.kv.write(slots, new_k, new_v)
        for s in seqs:
            s.block_table.num_tokens += t
        return logits.float()

    def choose_tokens(self, seqs: Seq[Sequence], logits: torch.Tensor) -> list[int]:
        """Next token of each row, chosen where the logits are in one call for the batch (one
        device sync): the argmax for greedy rows, a draw for sampled ones (the sampler a burst
        runs; see :mod:`edgeinfer.engine.sampling`). A row under its ``min_new_tokens`` cannot
        choose a stop token; a row whose thinking cap is spent gets the end of its thinking span.
        """
        for i, seq in enumerate(seqs):
            if len(seq.generated) < seq.sampling.min_new_tokens and seq.stop_token_ids:
                logits[i, list(seq.stop_token_ids)] = float("-inf")
        rows = sampling_rows(seqs)
        if rows.kind == GREEDY:
            chosen = logits.argmax(-1).tolist()
        else:
            chosen = rows.state(logits.shape[-1], logits.device).choose(logits).tolist()
        return [thinking_forced(s, token) for s, token in zip(seqs, chosen)]

    def _accept(self, seq: Sequence, token: int) -> None:
        reason = self.output.accept(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.timings.finished = time.perf_counter()

    # --- bursts ----------------------------------------------------------------------------
    def _burst_length(self, seqs: Seq[Sequence], joining: int, ahead: int = 0) -> int:
        """How many steps may run before the host looks again (1: step by step), after
        ``ahead`` steps already queued on the device whose tokens the host has not read.

        Only where the decoder engine can burst, no row's thinking is capped, every row is past its
        ``min_new_tokens``, no request waits to join (in the scheduler, nor ``joining`` outside it)
        nor is still in its prompt, and within the blocks each sequence holds (the scheduler gives
        rows room for a whole burst where it can), so the scheduler's accounting never runs behind.
        """
        if self.burst <= 1 or self.bursts is None or self.scheduler.waiting or joining or \
                self.scheduler.prompts_pending:
            return 1
        if any(s.thinking is not None and s.thinking.limit is not None for s in seqs):
            return 1  # a capped thinking span may need its end token forced at any step
        made = [len(s.generated) + ahead for s in seqs]
        if any(n < s.sampling.min_new_tokens and s.stop_token_ids for s, n in zip(seqs, made)):
            return 1
        room = min(len(s.block_table.blocks) * self.block_size - s.num_cached - ahead for s in seqs)
        left = max(s.sampling.max_new_tokens - n for s, n in zip(seqs, made))
        return max(1, min(self.burst, room, left))

    def _start_burst(self, seqs: Seq[Sequence], steps: int) -> BurstIds | None:
        assert self.bursts is not None  # _burst_length is 1 without them
        last, positions = decode_inputs(seqs)
        rows = sampling_rows(seqs)
        ids = self.bursts.decode_burst(last, positions, self.kv.k, self.kv.v, block_tables(seqs),
                                       torch.tensor([s.num_cached for s in seqs]), steps,
                                       None if rows.kind == GREEDY else rows)
        if ids is not None:
            self._count_burst(steps)
        return ids

    def _count_burst(self, steps: int) -> None:
        self.counters["decode_steps"] += steps
        self.counters["decode_bursts"] += 1

    def _collect_burst(self, joining: int) -> list[Sequence]:
        """Accept the tokens of the burst in flight, one by one as steps would, dropping those
        after a finish; the next burst of the same rows is queued first where it may be, so the
        device is not idle while the host reads these."""
        done, self._in_flight = self._in_flight, None
        assert done is not None
        self._in_flight = self._follow(done, joining)
        got: list[Sequence] = []
        for seq, row in zip(done.seqs, done.ids.rows()):
            for token in row:
                if seq.status is Status.FINISHED:
                    break  # the rest of this burst (all of it, when the one before finished the row) is dropped
                seq.block_table.num_tokens += 1  # the K/V of the token before it is in the pool
                self._accept(seq, token)
                if not got or got[-1] is not seq:
                    got.append(seq)
        return got

    def _follow(self, done: _Burst, joining: int) -> _Burst | None:
        """The next burst of ``done``'s rows, queued before ``done``'s tokens are read.

        Only where those tokens can change nothing but a stop: the same rows run and nobody
        waits to join, every row is still under its ``max_new_tokens`` and past its
        ``min_new_tokens`` after ``done``, and blank blocks hold both bursts' tokens. A row
        that stops inside ``done`` has the next burst's tokens dropped, as a burst drops those
        after a stop inside it (its slots are past its length, and its freed blocks are
        reused only by work queued behind).
        """
        seqs = done.seqs
        if self.bursts is None or tuple(self.scheduler.running) != seqs or \
                any(len(s.generated) + done.steps >= s.sampling.max_new_tokens for s in seqs):
            return None
        for seq in seqs:
            self.scheduler.reserve(seq, min(done.steps + self.burst, seq.sampling.max_new_tokens - len(seq.generated)))
        steps = self._burst_length(seqs, joining, ahead=done.steps)
        if steps < 2 or (ids := self.bursts.continue_burst(self.kv.k, self.kv.v, block_tables(seqs), steps)) is None:
            return None
        self._count_burst(steps)
        self.counters["decode_bursts_ahead"] += 1
        return _Burst(seqs, ids, steps)
