"""The KV manager and the spill mechanism without a model: a real pool of 4 blocks of 4 tokens,
a real KV tensor on the CPU, real host and disk tiers; a sequence's prefill writes K/V made
from its token ids, so every block's bytes are known."""

from __future__ import annotations

import errno
import itertools
import threading
from dataclasses import dataclass, field

import pytest
import torch

from edgeinfer.errors import CapacityError
from edgeinfer.kv.hashing import full_key
from edgeinfer.kv.manager import KVManager, KVManagerConfig
from edgeinfer.kv.pool import BlockPool, BlockTable, KVCache
from edgeinfer.kv.worker import Job

BS = 4
ROOT = b"\7" * 16
_ids = itertools.count()


@dataclass
class Seq:
    """The fields the KV manager reads and counts on (the engine's ``Sequence`` has the same)."""

    prompt_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_ids))
    generated: list[int] = field(default_factory=list)
    block_table: BlockTable = field(default_factory=lambda: BlockTable(BS))
    image_spans: tuple = ()
    prefix_tokens_reused: int = 0
    spilled_blocks: int = 0
    restored_blocks: int = 0
    recomputed_blocks: int = 0

    @property
    def prefill_target(self) -> int:
        return len(self.prompt_ids) if not self.generated else len(self.prompt_ids) + len(self.generated) - 1


def kv_of(tokens: list[int]) -> torch.Tensor:
    """K for ``tokens`` as the decoder would write it, [layers=2, 1, T, kv_heads=1, head_dim=3]: a
    pure function of the token id and its layer, with fractional bits so a bit flip shows."""
    ids = torch.tensor(tokens, dtype=torch.float32)
    layer = torch.arange(2, dtype=torch.float32)[:, None]
    values = (ids[None, :] * 1.37 + layer * 0.11)[..., None] + torch.tensor([0.013, 0.5, -2.25])
    return values[:, None, :, None, :]


def make(config: KVManagerConfig | None = None) -> KVManager:
    config = config or KVManagerConfig()
    cache = KVCache(num_layers=2, num_blocks=4, block_size=BS, kv_heads=1, head_dim=3, dtype=torch.float32)
    return KVManager(BlockPool(4, BS), cache, config, ROOT)


def prefill(manager: KVManager, seq: Seq) -> None:
    """Admit ``seq`` and compute what the cache did not give it, as the engine would."""
    assert manager.can_admit(seq, chunk=64)
    manager.admit(seq, chunk=64)
    manager.wait_ready(seq)
    table, start = seq.block_table, seq.block_table.num_tokens
    count = seq.prefill_target - start
    manager.allocate_for(seq, table.blocks_needed(count))
    k = kv_of(seq.prompt_ids[start:start + count])
    manager.cache.write(torch.tensor(table.slots(start, count)), k, -k)
    table.num_tokens += count
    manager.note_progress(seq)


def pool_k(manager: KVManager, seq: Seq) -> torch.Tensor:
    """The K the pool holds for ``seq``'s cached tokens, [layers, T, heads, dim]."""
    slots = seq.block_table.slots(0, seq.block_table.num_tokens)
    return manager.cache.k.view(2, -1, 1, 3)[:, slots]


def expected_k(seq: Seq) -> torch.Tensor:
    return kv_of(seq.prompt_ids[:seq.block_table.num_tokens])[:, 0]


PROMPT = list(range(100, 109))  # 9 tokens: two full blocks and one of a single token


def test_admission_shares_reused_blocks_and_counts_them():
    manager = make()
    first = Seq(PROMPT)
    prefill(manager, first)
    full_blocks = first.block_table.blocks[:2]
    manager.free(first)
    assert manager.pool.num_idle == 3 and manager.pool.num_blank == 1  # kept, reclaimable
    second = Seq(PROMPT[:8] + [999])
    assert manager.can_admit(second, chunk=64)
    assert manager.admit(second, chunk=64) == 8
    assert manager.ready(second) and second.block_table.blocks == full_blocks  # shared, not copied
    assert second.prefix_tokens_reused == 8 and second.restored_blocks == 0
    assert manager.counters()["prefix_hits"] == 1 and manager.counters()["prefix_tokens_reused"] == 8
    prefill(manager, second)
    assert torch.equal(pool_k(manager, second), expected_k(second))
    manager.check()


def test_reused_idle_blocks_are_not_counted_as_room_twice():
    manager = make()
    first = Seq(PROMPT)
    prefill(manager, first)
    manager.free(first)  # 3 idle blocks, 1 blank
    # Reusing the two full blocks takes them: 1 blank + the idle tail are left, 2 more blocks fit.
    assert manager.can_admit(Seq(PROMPT[:8] + list(range(8))), chunk=8)
    assert not manager.can_admit(Seq(PROMPT[:8] + list(range(9))), chunk=9)
    assert not manager.can_admit(Seq(list(range(17))), chunk=17)  # nothing reused: 5 blocks > 4


def test_spill_to_host_and_back_is_bit_exact():
    manager = make(KVManagerConfig(host_tier_mb=1))
    first = Seq(PROMPT)
    prefill(manager, first)
    before = pool_k(manager, first)[:, :8].clone()
    manager.free(first)
    assert manager.spill_idle("host") == 3  # two full blocks and the partial tail
    assert manager.pool.num_blank == 4
    manager.cache.k.fill_(float("nan"))  # nothing on the device is left to find
    manager.cache.v.fill_(float("nan"))
    again = Seq(PROMPT)
    manager.admit(again, chunk=64)
    manager.wait_ready(again)
    assert again.block_table.num_tokens == 8 and again.restored_blocks == 2 and again.prefix_tokens_reused == 8
    assert torch.equal(pool_k(manager, again), before)  # the very bytes, at full precision
    assert torch.equal(manager.cache.v.view(2, -1, 1, 3)[:, again.block_table.slots(0, 8)], -before)
    metrics = manager.metrics()
    assert metrics.restored_blocks == 2 and metrics.restore_bytes == 2 * manager.codec.nbytes
    manager.check()


def spilled_to_disk(tmp_path) -> tuple[KVManager, Seq]:
    manager = make(KVManagerConfig(disk_tier_mb=1, disk_dir=str(tmp_path)))
    first = Seq(PROMPT)
    prefill(manager, first)
    manager.free(first)  # written through to disk in the background
    manager.flush()
    manager.spill_idle("disk")  # the device copies go: the disk holds the only ones
    assert manager.pool.num_blank == 4 and manager.metrics().tiers["disk"].used_blocks == 3
    return manager, first


def flip_a_byte(manager: KVManager, block: int) -> None:
    """One flipped byte in the disk slot of the prompt's ``block``-th full block."""
    parent = ROOT
    for b in range(block + 1):
        parent = full_key(parent, PROMPT[b * BS:(b + 1) * BS], (), b * BS)
    slot = next(e.disk for e in manager.index.entries() if e.key == parent)
    with open(manager.disk.dir / "blocks.dat", "r+b") as f:
        f.seek(slot * manager.codec.nbytes + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("bad", [0, 1])
def test_a_block_failing_its_checksum_is_recomputed_and_never_reported_reused(tmp_path, bad):
    manager, _ = spilled_to_disk(tmp_path)
    flip_a_byte(manager, bad)
    again = Seq(PROMPT)
    manager.admit(again, chunk=64)
    manager.wait_ready(again)
    # The table is cut before the bad block; every block after it is recomputed too.
    assert again.block_table.num_tokens == bad * BS and len(again.block_table.blocks) == bad
    assert again.prefix_tokens_reused == bad * BS and again.restored_blocks == bad
    assert again.recomputed_blocks == 2 - bad
    counters = manager.counters()
    assert counters["recomputes"] == 1 and counters["restored_blocks"] == bad
    assert counters["prefix_hits"] == (bad > 0) and counters["prefix_tokens_reused"] == bad * BS
    assert len(manager.disk.records) == 2  # the bad block is deleted from the disk tier
    manager.check()
    prefill(manager, again)
    assert torch.equal(pool_k(manager, again), expected_k(again))
    manager.close()


def test_room_that_cannot_be_made_is_refused_before_anything_is_given_up():
    manager = make()
    first = Seq(PROMPT)
    prefill(manager, first)
    manager.free(first)  # 3 idle blocks hold the prefix cache
    running = Seq([1, 2])
    prefill(manager, running)  # takes the one blank block
    entries = {id(e) for e in manager.index.entries()}
    assert not manager.can_allocate(4)
    with pytest.raises(CapacityError, match="4 needed"):
        manager.allocate_for(running, 4)
    assert {id(e) for e in manager.index.entries()} == entries and manager.pool.num_idle == 3
    manager.check()
    manager.allocate_for(running, 3)  # the policy gives the idle blocks up, all of them
    assert manager.pool.num_idle == 0 and len(running.block_table.blocks) == 4
    manager.check()


def test_a_preempted_sequence_is_stored_in_two_phases_and_restored_whole():
    manager = make(KVManagerConfig(host_tier_mb=1))
    seq = Seq(PROMPT)
    prefill(manager, seq)
    want = pool_k(manager, seq).clone()
    gate = threading.Event()
    manager.worker.submit(Job(gate.wait, urgent=True))  # the worker is busy: the spill stays prepared
    manager.preempt(seq)
    device = manager.metrics().tiers["device"].blocks
    assert device["storing"] == 3 and device["free"] == 1  # referenced by the spill, not blank yet
    assert manager.can_allocate(4) and not manager.has_blank(2)  # room once the spill completes
    manager.check()
    gate.set()
    manager.flush()
    assert manager.pool.num_blank == 4 and manager.metrics().tiers["host"].blocks["preempted"] == 3
    assert seq.spilled_blocks == 3
    manager.admit(seq, chunk=64)
    manager.wait_ready(seq)
    # The full blocks come back; the last prompt token is computed again (its logits are needed).
    assert seq.block_table.num_tokens == 8 and seq.restored_blocks == 2
    assert torch.equal(pool_k(manager, seq), want[:, :8])
    assert seq.prefix_tokens_reused == 0  # a restore is not a prefix hit
    manager.check()


def test_a_full_disk_rolls_a_background_spill_back_and_the_blocks_stay(tmp_path, monkeypatch, caplog):
    manager = make(KVManagerConfig(disk_tier_mb=1, disk_dir=str(tmp_path), write_through=False,
                                   high_watermark=0.5, low_watermark=0.25))
    seq = Seq(PROMPT)
    prefill(manager, seq)
    want = pool_k(manager, seq)[:, :8].clone()

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("edgeinfer.kv.disk.os.pwrite", no_space)
    manager.free(seq)  # 3 of 4 blocks hold content, over the high watermark: 2 spill in the background
    manager.flush()
    metrics = manager.metrics()
    assert metrics.disk_errors == 1 and metrics.spilled_blocks == 0 and manager.pool.num_idle == 3
    assert metrics.tiers["disk"].capacity_blocks == 0  # shrunk to what the file holds
    assert manager.spill_idle("disk") == 0 and manager.pool.num_idle == 3  # nowhere to go: they stay
    assert caplog.text.count("disk is full") == 1
    manager.check()
    again = Seq(PROMPT)
    assert manager.admit(again, chunk=64) == 8 and again.restored_blocks == 0  # still on the device
    assert torch.equal(pool_k(manager, again), want)
    manager.close()
