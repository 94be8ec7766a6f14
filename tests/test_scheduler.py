"""The scheduler on a real KV manager over a real 4-block pool (block size 4), no model.

What the runner does to the bookkeeping after each unit of work (the chunk's or the step's
K/V written, one token accepted) is done here by hand: that is the boundary.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.engine.scheduler import DecodeWork, PrefillWork, Scheduler
from edgeinfer.engine.sequence import FinishReason, Sequence, Status
from edgeinfer.errors import CapacityError
from edgeinfer.kv.manager import KVManager, KVManagerConfig
from edgeinfer.kv.pool import BlockPool, BlockTable, KVCache

BLOCK = 4
_tokens = itertools.count(1000)  # every sequence its own ids: no two share a prefix


@pytest.fixture
def kv():
    manager = _manager(prefix_cache=True)
    yield manager
    manager.close()


def _manager(prefix_cache: bool) -> KVManager:
    pool = BlockPool(4, BLOCK)
    cache = KVCache(num_layers=1, num_blocks=4, block_size=BLOCK, kv_heads=1, head_dim=2, dtype=torch.float32)
    return KVManager(pool, cache, KVManagerConfig(prefix_cache=prefix_cache))


def scheduler_for(kv: KVManager, max_batch_size: int = 4, lookahead: int = 1) -> Scheduler:
    return Scheduler(kv, max_batch_size, prefill_chunk=512, max_context=64, lookahead=lookahead)


def sequence(prompt_len: int, max_new_tokens: int = 16, temperature: float = 0.0) -> Sequence:
    return Sequence(prompt_ids=[next(_tokens) for _ in range(prompt_len)], prompt_embeds=torch.zeros(prompt_len, 2),
                    prompt_positions=torch.arange(prompt_len), next_position=prompt_len,
                    sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=0),
                    stop_token_ids=frozenset(), block_table=BlockTable(BLOCK))


def run(work: PrefillWork | DecodeWork | None, token: int = 7) -> None:
    """The runner's effect on the bookkeeping: new K/V in the pool, a token accepted."""
    assert work is not None
    if isinstance(work, PrefillWork):
        work.seq.block_table.num_tokens += work.end - work.start
        if work.samples:
            work.seq.generated.append(token)
        return
    for seq in work.seqs:
        seq.block_table.num_tokens += 1
        seq.generated.append(token)


def started(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Add ``seqs`` and run each one's whole prompt (one chunk each, oldest first)."""
    for seq in seqs:
        scheduler.add(seq)
    for seq in seqs:
        work = scheduler.schedule()
        assert isinstance(work, PrefillWork) and work.seq is seq and work.end == seq.prompt_len
        run(work)


# --------------------------------------------------------------------------- admission


def test_a_prompt_larger_than_the_pool_is_refused_when_added(kv):
    scheduler = scheduler_for(kv)
    with pytest.raises(CapacityError, match="needs 5 KV blocks, the pool has 4"):
        scheduler.add(sequence(16))  # 16 tokens and the first generated one: 5 blocks of 4
    assert not scheduler.has_work()


def test_admission_checks_first_and_changes_nothing_when_the_chunk_does_not_fit(kv):
    scheduler = scheduler_for(kv)
    older, newer = sequence(9), sequence(6)
    started(scheduler, older)  # 3 blocks
    scheduler.add(newer)  # needs 2, one is blank
    work = scheduler.schedule()
    assert work == DecodeWork((older,))
    assert newer.status is Status.WAITING and not kv.is_placed(newer) and newer.block_table.blocks == []
    assert kv.pool.num_blank == 1 and scheduler.preemptions == 0  # nobody was made room for
    run(work)
    scheduler.finish(older, FinishReason.LENGTH)
    work = scheduler.schedule()
    assert isinstance(work, PrefillWork) and work.seq is newer and (work.start, work.end) == (0, 6)
    assert newer.status is Status.RUNNING and len(newer.block_table.blocks) == 2


# --------------------------------------------------------------------------- prompts beside decoding


def test_running_rows_decode_a_step_after_each_chunk_of_a_new_prompt():
    manager = KVManager(BlockPool(8, BLOCK), KVCache(num_layers=1, num_blocks=8, block_size=BLOCK, kv_heads=1,
                                                     head_dim=2, dtype=torch.float32), KVManagerConfig())
    scheduler = Scheduler(manager, 4, prefill_chunk=4, max_context=64)
    old, new, newer = sequence(4), sequence(8), sequence(4)
    scheduler.add(old)
    first = scheduler.schedule()
    assert isinstance(first, PrefillWork) and first.seq is old
    run(first)
    scheduler.add(new)
    scheduler.add(newer)
    order = []
    for _ in range(6):
        work = scheduler.schedule()
        order.append((work.seq, work.start) if isinstance(work, PrefillWork) else work.seqs)
        run(work)
    # Each chunk of a prompt (4 tokens) is followed by a step of the rows past their prompts;
    # the chunks themselves go oldest first, and a row joins the step once its prompt is done.
    assert order == [(new, 0), (old,), (new, 4), (old, new), (newer, 0), (old, new, newer)]
    manager.close()


def test_a_prompt_chunk_that_ran_beside_no_decoding_row_is_not_followed_by_a_step(kv):
    scheduler = scheduler_for(kv)
    a, b = sequence(4), sequence(4)
    scheduler.add(a)
    scheduler.add(b)
    works = [scheduler.schedule()]
    run(works[0])
    works.append(scheduler.schedule())
    assert [(w.seq, type(w)) for w in works] == [(a, PrefillWork), (b, PrefillWork)]
    kv.close()


# --------------------------------------------------------------------------- preemption


def test_the_newest_sequence_is_preempted_when_an_older_one_is_short(kv):
    scheduler = scheduler_for(kv)
    older, newer = sequence(7), sequence(7)
    started(scheduler, older, newer)  # two blocks each: the pool is full
    assert kv.pool.num_blank == 0
    run(scheduler.schedule())  # both 8th tokens fit their second block
    work = scheduler.schedule()  # the older one's 9th token needs a third block
    assert work == DecodeWork((older,))
    assert scheduler.preemptions == 1 and newer.status is Status.WAITING and list(scheduler.waiting) == [newer]
    assert newer.block_table.blocks == [] and len(older.block_table.blocks) == 3
    run(work)
    scheduler.finish(older, FinishReason.LENGTH)
    work = scheduler.schedule()  # it comes back and caches again what it had (prompt + first token)
    assert isinstance(work, PrefillWork) and work.seq is newer and work.end == newer.num_tokens - 1 == 8
    assert newer.status is Status.RUNNING and not work.samples


def test_the_newest_gives_up_its_own_blocks_when_it_is_the_one_short(kv):
    scheduler = scheduler_for(kv)
    older, newer = sequence(5), sequence(8)
    started(scheduler, older, newer)  # two blocks each; the newer one's are full
    work = scheduler.schedule()
    assert work == DecodeWork((older,))
    assert scheduler.preemptions == 1 and newer.status is Status.WAITING
    assert len(older.block_table.blocks) == 2  # nothing taken from the older one


def test_a_sequence_alone_that_outgrows_the_pool_is_a_capacity_error(kv):
    scheduler = scheduler_for(kv)
    seq = sequence(15)
    started(scheduler, seq)  # 4 blocks: the 16th token still fits
    run(scheduler.schedule())
    with pytest.raises(CapacityError, match="4 blocks in all"):
        scheduler.schedule()


# --------------------------------------------------------------------------- burst reservation


def test_a_greedy_row_is_given_room_for_a_burst_from_blank_blocks(kv):
    scheduler = scheduler_for(kv, lookahead=8)
    seq = sequence(3)
    started(scheduler, seq)
    assert scheduler.schedule() == DecodeWork((seq,))
    assert len(seq.block_table.blocks) == 3  # 3 cached + 8 ahead = 11 tokens
    assert kv.pool.num_blank == 1


def test_a_burst_reservation_gives_up_no_idle_block(kv):
    scheduler = scheduler_for(kv, lookahead=8)
    done = sequence(11)
    started(scheduler, done)
    scheduler.finish(done, FinishReason.STOP)  # its three blocks stay idle in the prefix cache
    seq = sequence(3)
    started(scheduler, seq)
    assert kv.pool.num_blank == 0 and kv.pool.num_idle == 3
    assert scheduler.schedule() == DecodeWork((seq,))
    assert len(seq.block_table.blocks) == 1 and kv.pool.num_idle == 3


def test_no_burst_reservation_while_a_request_waits(kv):
    scheduler = scheduler_for(kv, lookahead=8)
    seq, waiting = sequence(3), sequence(13)
    started(scheduler, seq)
    scheduler.add(waiting)  # 4 blocks: it cannot be placed while one is held
    assert scheduler.schedule() == DecodeWork((seq,))
    assert waiting.status is Status.WAITING and len(seq.block_table.blocks) == 1 and kv.pool.num_blank == 3


def test_a_sampled_row_is_given_burst_room_as_a_greedy_one(kv):
    """Sampled rows burst too (the sampler runs on the device)."""
    scheduler = scheduler_for(kv, lookahead=8)
    seq = sequence(3, temperature=1.0)
    started(scheduler, seq)
    assert scheduler.schedule() == DecodeWork((seq,))
    assert len(seq.block_table.blocks) == 3 and kv.pool.num_blank == 1


# --------------------------------------------------------------------------- finishing


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_finishing_gives_every_block_back(prefix_cache):
    kv = _manager(prefix_cache)
    scheduler = scheduler_for(kv)
    first, second = sequence(7), sequence(6)
    started(scheduler, first, second)
    run(scheduler.schedule())
    owned = first.block_table.blocks + second.block_table.blocks
    assert len(owned) == 4 and kv.pool.num_free == 0
    scheduler.finish(first, FinishReason.STOP)
    scheduler.finish(second, FinishReason.CANCELLED)
    assert all(kv.pool.refcount(b) == 0 for b in owned) and kv.pool.num_free == 4
    assert kv.pool.num_idle == (4 if prefix_cache else 0)  # cached content stays, idle, for a follow-up
    assert first.block_table.blocks == [] and not scheduler.has_work()
    assert (first.status, first.finish_reason) == (Status.FINISHED, FinishReason.STOP)
    scheduler.finish(first, FinishReason.LENGTH)  # a second finish changes nothing
    assert first.finish_reason is FinishReason.STOP and kv.pool.num_free == 4
    kv.close()
