"""The scheduler decides what runs next: a prefill chunk of one sequence, or a decode batch.

Control only: it asks the block pool (mechanism) for blocks through check-then-do
calls and never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from edgeinfer.engine.sequence import FinishReason, Sequence, Status
from edgeinfer.errors import CapacityError
from edgeinfer.kv.pool import BlockPool


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
    def __init__(self, pool: BlockPool, max_batch_size: int, prefill_chunk: int, max_context: int) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        need = self.pool.blocks_for(seq.prompt_len + 1)
        if need > self.pool.num_blocks:
            raise CapacityError(
                f"prompt of {seq.prompt_len} tokens needs {need} KV blocks, the pool has {self.pool.num_blocks}"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> PrefillWork | DecodeWork | None:
        for seq in self.running:
            if seq.in_prefill:
                return self._prefill(seq)
        if self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if self.pool.can_allocate(self._chunk_blocks(seq)):
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                return self._prefill(seq)
            if not self.running:
                raise CapacityError(f"KV pool cannot hold sequence {seq.seq_id}'s first chunk")
        if self.running:
            return self._decode()
        return None

    def _chunk_end(self, seq: Sequence) -> int:
        return min(seq.prefill_target, seq.num_cached + self.prefill_chunk)

    def _chunk_blocks(self, seq: Sequence) -> int:
        return seq.block_table.blocks_needed(self._chunk_end(seq) - seq.num_cached)

    def _prefill(self, seq: Sequence) -> PrefillWork:
        need = self._chunk_blocks(seq)
        while not self.pool.can_allocate(need):
            victim = self._victim(exclude=seq)
            if victim is None:
                raise CapacityError(f"KV pool cannot hold sequence {seq.seq_id}'s next chunk")
            self.preempt(victim)
        seq.block_table.blocks += self.pool.allocate(need)
        return PrefillWork(seq, seq.num_cached, self._chunk_end(seq))

    def _decode(self) -> DecodeWork:
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted while making room for an earlier one
            need = seq.block_table.blocks_needed(1)
            while not self.pool.can_allocate(need):
                victim = self._victim(exclude=seq)
                if victim is None:
                    raise CapacityError("KV pool is too small for one sequence's next token")
                self.preempt(victim)
            seq.block_table.blocks += self.pool.allocate(need)
        return DecodeWork(tuple(self.running))

    def _victim(self, exclude: Sequence) -> Sequence | None:
        """The newest running sequence other than ``exclude`` (it has the least work to redo)."""
        for seq in reversed(self.running):
            if seq is not exclude:
                return seq
        return None

    def preempt(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back; it is recomputed when re-admitted."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table.blocks)
        seq.block_table.blocks = []
        seq.block_table.num_tokens = 0
