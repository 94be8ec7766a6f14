"""The scheduler decides what runs next: a prefill chunk of one sequence, or a decode batch.

Prompts go first, a chunk (``prefill_chunk`` tokens) at a time, and one decode step of the
rows past their prompts follows each chunk while both wait: a new picture's prompt never
stalls the running rows for more than a chunk, and its first token is not held behind their
decoding (chunked prefill, the chunk being the budget of a step).

Control only: it asks the KV manager for blocks through check-then-do calls
(``can_admit``/``admit``, ``can_allocate``/``allocate_for``) and never touches tensors.
Sequences are served first come, first served: when a running sequence needs a block and
none can be made, the newest sequence holding blocks is preempted (the one asking, if it
is the newest): the KV manager spills it whole and restores it when it is admitted again.
The oldest sequence is never preempted, so it always finishes.
The sequence at the head of the queue is placed as soon as there is room, even while
the batch is full, so the blocks it had spilled come back while others decode.
With ``lookahead`` > 1 (an engine that decodes in bursts), a running sequence is given
room for that many tokens where blank blocks are spare and nobody waits; never by
spilling or preempting anyone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from edgeinfer.engine.sequence import FinishReason, Sequence, Status
from edgeinfer.errors import CapacityError
from edgeinfer.kv.manager import KVManager


@dataclass(frozen=True, slots=True)
class PrefillWork:
    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The chunk that completes a fresh prompt yields the first token."""
        return self.end == self.seq.prompt_len and not self.seq.generated


@dataclass(frozen=True, slots=True)
class DecodeWork:
    seqs: tuple[Sequence, ...]


class Scheduler:
    def __init__(self, kv: KVManager, max_batch_size: int, prefill_chunk: int, max_context: int,
                 lookahead: int = 1) -> None:
        self.kv = kv
        self.lookahead = lookahead
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._decode_due = False  # a prompt chunk ran while rows were decoding: they step next

    def add(self, seq: Sequence) -> None:
        need = self.kv.blocks_for(seq.prompt_len + 1)
        if need > self.kv.num_blocks:
            raise CapacityError(
                f"prompt of {seq.prompt_len} tokens needs {need} KV blocks, the pool has {self.kv.num_blocks}"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prompts_pending(self) -> int:
        """How many sequences here, waiting or running, have prompt chunks still to run: while any
        has, the decode steps are single steps, not bursts; a server admits by the count."""
        return sum(s.in_prefill for s in (*self.waiting, *self.running))

    def schedule(self) -> PrefillWork | DecodeWork | None:
        self.kv.poll()
        if self._decode_due:
            self._decode_due = False
            if (work := self._decode()).seqs:
                return work
        for seq in list(self.running):
            if seq.in_prefill and seq in self.running and (work := self._prefill(seq)) is not None:
                return self._prefilling(work)
        admitted = self._admit()
        if admitted is not None and admitted.in_prefill and (work := self._prefill(admitted)) is not None:
            return self._prefilling(work)
        if self.running:
            work = self._decode()
            if work.seqs:
                return work
        if self.waiting:  # the head's blocks are still loading and nothing else can run
            self.kv.wait_ready(self.waiting[0])
            return self.schedule()
        return None

    def _admit(self) -> Sequence | None:
        """Place the head of the queue when there is room; start it when it is ready and a slot is free."""
        if not self.waiting:
            return None
        seq = self.waiting[0]
        batch_full = len(self.running) >= self.max_batch_size
        if not self.kv.is_placed(seq):
            if not self.kv.can_admit(seq, self.prefill_chunk, spare=len(self.running) if batch_full else 0):
                if not self.running:
                    raise CapacityError(f"KV pool cannot hold sequence {seq.seq_id}'s first chunk")
                return None
            self.kv.admit(seq, self.prefill_chunk)
        if batch_full or not self.kv.ready(seq):
            return None
        self.waiting.popleft()
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.running.sort(key=_arrival)
        return seq

    def _chunk_end(self, seq: Sequence) -> int:
        return min(seq.prefill_target, seq.chunk_end(seq.num_cached + self.prefill_chunk))

    def _prefill(self, seq: Sequence) -> PrefillWork | None:
        """The next chunk of ``seq``, or None when ``seq`` had to give its blocks up."""
        self.kv.note_progress(seq)
        need = seq.block_table.blocks_needed(self._chunk_end(seq) - seq.num_cached)
        if not self._make_room(seq, need):
            return None
        return PrefillWork(seq, seq.num_cached, self._chunk_end(seq))

    def _prefilling(self, work: PrefillWork) -> PrefillWork:
        """``work``, noting that the rows past their prompts decode a step after it."""
        self._decode_due = any(not s.in_prefill for s in self.running if s is not work.seq)
        return work

    def _decode(self) -> DecodeWork:
        """A step of every running row past its prompt, oldest first."""
        for seq in list(self.running):  # oldest first: it gets blocks before anyone else
            if seq not in self.running or seq.in_prefill:
                continue  # preempted while making room for an older one, or still in its prompt
            self.kv.note_progress(seq)
            need = seq.block_table.blocks_needed(1)
            if need:
                self._make_room(seq, need)
            if self.lookahead > 1 and seq in self.running:
                self.reserve(seq, min(self.lookahead, seq.sampling.max_new_tokens - len(seq.generated)))
        return DecodeWork(tuple(s for s in self.running if not s.in_prefill))

    def reserve(self, seq: Sequence, tokens: int) -> None:
        """Blank blocks so that ``seq`` holds room for ``tokens`` more tokens, where they are
        spare and nobody waits: never by spilling or preempting anyone."""
        spare = seq.block_table.blocks_needed(tokens)
        if spare and not self.waiting and self.kv.has_blank(spare):
            self.kv.allocate_for(seq, spare)

    def _make_room(self, seq: Sequence, need: int) -> bool:
        """``need`` more blocks for ``seq``, preempting newer sequences; False when ``seq`` is the newest
        and was preempted itself."""
        while not self.kv.can_allocate(need):
            victim = self._victim()
            if victim is seq and len(self.running) + self._placed_head() == 1:
                raise CapacityError(f"KV pool is too small for sequence {seq.seq_id}'s next "
                                    f"{need} block(s): {self.kv.num_blocks} blocks in all")
            self.preempt(victim)
            if victim is seq:
                return False
        self.kv.allocate_for(seq, need)
        return True

    def _placed_head(self) -> int:
        return int(bool(self.waiting) and self.kv.is_placed(self.waiting[0]))

    def _victim(self) -> Sequence:
        """The newest sequence holding blocks: running, or placed at the head of the queue."""
        holders = self.running + ([self.waiting[0]] if self._placed_head() else [])
        return max(holders, key=_arrival)

    def preempt(self, seq: Sequence) -> None:
        """Spill a sequence's blocks; it is restored (or, where blocks were lost, recomputed) when re-admitted."""
        if seq in self.running:
            self.running.remove(seq)
            at = next((i for i, w in enumerate(self.waiting) if _arrival(w) > _arrival(seq)), len(self.waiting))
            self.waiting.insert(at, seq)
            self.preemptions += 1
        self.kv.preempt(seq)
        seq.status = Status.WAITING

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason


def _arrival(seq: Sequence) -> int:
    """Sequence ids grow with submission: a smaller one arrived first and is served first."""
    return seq.seq_id
