"""The spill manager: where each cached block lives, and moving it between device, host and disk.

It owns the host and disk tiers, one eviction policy per tier, the spill worker and the
transfers in flight. The KV manager asks it for room (``reclaim``), to spill entries, to
load them back (``start_load``), and calls ``poll`` once per step.

Candidates: on the device, idle entries (their block is cached but nobody owns it); on
the host and the disk, every entry there that no transfer is using. A transfer is
prepared here (destination reserved, device sources referenced, entries busy), runs on
the worker (:class:`~edgeinfer.kv.transfer.Mover`) and is completed or rolled back
here, on the engine's thread, in ``collect``.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from edgeinfer.errors import CapacityError
from edgeinfer.kv.codec import BlockCodec, BlockGeometry
from edgeinfer.kv.disk import (
    DiskBusyError,
    DiskLayout,
    DiskStore,
    EmbeddingFiles,
    default_cache_dir,
)
from edgeinfer.kv.entry import Entry, PrefixIndex, Tier
from edgeinfer.kv.host import HostStore
from edgeinfer.kv.metrics import KVStats
from edgeinfer.kv.policy import EvictionPolicy, make_policy
from edgeinfer.kv.pool import BlockPool, KVCache
from edgeinfer.kv.transfer import Move, Mover
from edgeinfer.kv.worker import Job, SpillWorker

log = logging.getLogger(__name__)


class SpillManager:
    def __init__(self, pool: BlockPool, cache: KVCache, codec: BlockCodec, index: PrefixIndex, config, *,
                 layout: DiskLayout, available_memory: Callable[[], int], clock: Callable[[], float]) -> None:
        self.pool = pool
        self.cache = cache
        self.codec = codec
        self.index = index
        self.config = config
        self.stats = KVStats()
        self.policies: dict[Tier, EvictionPolicy] = {tier: make_policy(config.policy) for tier in Tier}
        self.host = self._open_host()
        self.disk, self.embeddings = self._open_disk(layout)
        self.worker = SpillWorker(cache.device)
        self.mover = Mover(cache, codec, self.host, self.disk, config.pin_host)
        self.moves: dict[Job, Move] = {}
        self.landed: list[Move] = []  # completed loads, for the KV manager to settle
        self.device_pins: dict[int, int] = {}  # device block -> stores reading it
        self.loading: set[int] = set()  # device blocks being written by loads
        self.step = 0
        self._warned: set[str] = set()
        self._available_memory = available_memory
        self._clock = clock
        self._next_memory_check = 0.0
        self.floor_breached = False
        self._shut = False
        self._adopt_disk_records()

    # --- tiers -------------------------------------------------------------------------------
    def _open_host(self) -> HostStore | None:
        capacity = self.config.host_tier_mb * 2**20 // self.codec.nbytes
        return HostStore(capacity, self.codec.nbytes, pin=self.config.pin_host) if capacity else None

    def _open_disk(self, layout: DiskLayout) -> tuple[DiskStore | None, EmbeddingFiles | None]:
        capacity = self.config.disk_tier_mb * 2**20 // self.codec.nbytes
        if not capacity:
            return None, None
        root = Path(self.config.disk_dir).expanduser() if self.config.disk_dir else default_cache_dir()
        try:
            disk = DiskStore(root, layout, capacity)
        except DiskBusyError as error:
            log.warning("%s; this engine runs without a disk tier", error)
            return None, None
        except OSError as error:
            log.warning("cannot use KV cache folder %s (%s); this engine runs without a disk tier", root, error)
            return None, None
        return disk, EmbeddingFiles(disk.dir / "vision")

    def _adopt_disk_records(self) -> None:
        """Index the blocks a previous run left on disk."""
        if self.disk is None:
            return
        for slot, record in sorted(self.disk.records.items()):
            if self.index.knows(record.key):
                self.disk.release(slot)
                continue
            entry = Entry(record.key, record.valid, record.aliases, disk=slot)
            self.index.add(entry)
            self.policies[Tier.DISK].insert(entry, 0, entry.priority)

    @property
    def has_lower_tier(self) -> bool:
        return self.host is not None or self.disk is not None

    def store_of(self, tier: Tier) -> HostStore | DiskStore | None:
        return self.host if tier is Tier.HOST else self.disk

    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    # --- device copies and candidates ------------------------------------------------------------
    def attach(self, entry: Entry, block: int) -> None:
        """``block`` now holds ``entry``'s content (cached: it stays when its owners free it)."""
        entry.device = block
        self.pool.mark_cached(block)
        self.index.on_device[block] = entry

    def take(self, entry: Entry) -> None:
        """One more reference to an entry's device block."""
        if self.pool.is_idle(entry.device):
            self.policies[Tier.DEVICE].remove(entry)
        self.pool.revive(entry.device)
        self.touch(entry)

    def touch(self, entry: Entry) -> None:
        for tier in Tier:
            if entry.where(tier) is not None:
                self.policies[tier].touch(entry, self.step)

    def settle(self, entry: Entry) -> None:
        """After a reference to its block was dropped: an idle block becomes a candidate."""
        if entry.device is not None and self.pool.is_idle(entry.device) and entry.busy is None:
            self.policies[Tier.DEVICE].insert(entry, self.step, entry.priority)

    def reprioritize(self, entry: Entry) -> None:
        for tier in Tier:
            if entry in self.policies[tier]:
                self.policies[tier].insert(entry, self.step, entry.priority)

    def withdraw(self, entries: list[Entry], tier: Tier) -> None:
        for entry in entries:
            self.policies[tier].remove(entry)

    def drop(self, entry: Entry, tier: Tier) -> None:
        """Forget ``entry``'s copy in ``tier`` (the entry is not busy; a device copy is idle)."""
        self.policies[tier].remove(entry)
        where = entry.where(tier)
        if tier is Tier.DEVICE:
            del self.index.on_device[where]
            self.pool.uncache(where)
        else:
            self.store_of(tier).release(where)
        setattr(entry, tier.value, None)
        if not entry.located:
            self.index.forget(entry)
            self.stats.lost_blocks += entry.pins > 0

    # --- room ----------------------------------------------------------------------------------
    def spill_only(self, block: int) -> bool:
        """Only a spill in flight holds device ``block``: it is blank once the spill completes."""
        pins = self.device_pins.get(block, 0)
        return pins > 0 and self.pool.refcount(block) == pins

    def pinned_only(self) -> int:
        """Device blocks only a spill in flight holds: blank once it completes."""
        return sum(1 for b in list(self.device_pins) if self.spill_only(b))

    def reclaimable(self) -> int:
        return len(self.policies[Tier.DEVICE]) + self.pinned_only()

    def reclaim(self, n: int) -> None:
        """Make ``n`` blank device blocks, spilling or dropping idle ones; waits for spills it needs."""
        while self.pool.num_blank < n:
            policy = self.policies[Tier.DEVICE]
            short = n - self.pool.num_blank
            victims = policy.evict(min(short, len(policy)), self.step) if len(policy) else []
            if not victims:
                spills = [m for m in self.moves.values() if m.src is Tier.DEVICE]
                if not spills:
                    raise CapacityError(f"KV pool has {self.pool.num_blank} free blocks, {n} needed")
                self.wait(spills[0])
                continue
            if self.spill(victims, urgent=True, lose_unplaced=True):
                for move in [m for m in self.moves.values() if m.src is Tier.DEVICE and m.job.urgent]:
                    self.wait(move)

    def spill(self, entries: list[Entry], urgent: bool, lose_unplaced: bool, only: Tier | None = None) -> int:
        """Store idle device entries to the host (or the disk, or ``only`` there) and drop them from
        the device when done; an entry that already has a copy there is dropped now. Entries with nowhere to go are dropped now (``lose_unplaced``: their room is needed)
        or stay idle on the device. Returns how many are being stored."""
        lower = (only,) if only else (Tier.HOST, Tier.DISK)
        for entry in entries:  # a copy below already: the device copy just goes
            if any(entry.where(tier) is not None for tier in lower):
                self.drop(entry, Tier.DEVICE)
        entries = [e for e in entries if e.device is not None]
        if not entries:
            return 0
        self.withdraw(entries, Tier.DEVICE)
        to_host, to_disk = self._destinations(entries, only)
        for tier, items in ((Tier.HOST, to_host), (Tier.DISK, to_disk)):
            if items:
                self.start_store([e for e, _ in items], Tier.DEVICE, tier, [s for _, s in items],
                                 drop_source=True, reason="spill", urgent=urgent)
        placed = {id(e) for e, _ in to_host + to_disk}
        for entry in entries:
            if id(entry) in placed:
                continue
            if lose_unplaced:
                self.drop(entry, Tier.DEVICE)
            else:
                self.settle(entry)
        return len(placed)

    def _destinations(self, entries: list[Entry], only: Tier | None
                      ) -> tuple[list[tuple[Entry, int]], list[tuple[Entry, int]]]:
        """Slots for ``entries``: the host tier first (not while memory is under the floor), then disk."""
        to_host, to_disk = [], []
        use_host = only in (None, Tier.HOST) and not self.floor_breached
        use_disk = only in (None, Tier.DISK)
        for entry in entries:
            slot = self.reserve(Tier.HOST) if use_host else None
            if slot is not None:
                to_host.append((entry, slot))
            elif use_disk and (slot := self.reserve(Tier.DISK)) is not None:
                to_disk.append((entry, slot))
        return to_host, to_disk

    def reserve(self, tier: Tier) -> int | None:
        """A free slot in ``tier``, evicting its least valuable entry when it is full."""
        store = self.store_of(tier)
        if store is None:
            return None
        slot = store.reserve()
        if slot is None:
            victims = self.policies[tier].evict(1, self.step)
            if victims:
                self.drop(victims[0], tier)
                slot = store.reserve()
        return slot

    def persist(self, entries: list[Entry]) -> None:
        """Write entries through to disk in the background, keeping their other copies."""
        if self.disk is None:
            return
        for tier in (Tier.DEVICE, Tier.HOST):
            items = [(e, s) for e in entries if e.where(tier) is not None and e.busy is None and e.disk is None
                     and (s := self.reserve(Tier.DISK)) is not None]
            if items:
                self.start_store([e for e, _ in items], tier, Tier.DISK, [s for _, s in items],
                                 drop_source=False, reason="persist", urgent=False)

    # --- transfers -----------------------------------------------------------------------------
    def start_store(self, entries: list[Entry], src: Tier, dst: Tier, slots: list[int], *, drop_source: bool,
                    reason: str, urgent: bool) -> Move:
        move = Move("store", reason, src, dst, entries, [e.where(src) for e in entries], slots,
                    drop_source=drop_source)
        for entry in entries:
            self.policies[src].remove(entry)
            if src is Tier.DEVICE:
                self.pool.revive(entry.device)
                self.device_pins[entry.device] = self.device_pins.get(entry.device, 0) + 1
            entry.busy = move
        return self._submit(move, urgent)

    def start_load(self, seq_id: int, src: Tier, items: list[tuple[Entry, int, bool]]) -> Move:
        """Load (entry, device block, private) triples from ``src``; private blocks belong to the sequence."""
        entries = [e for e, _, _ in items]
        move = Move("load", "restore", src, Tier.DEVICE, entries, [e.where(src) for e in entries],
                    [b for _, b, _ in items], private=[p for _, _, p in items], seq_id=seq_id)
        for entry in entries:
            self.policies[src].remove(entry)
            entry.busy = move
        self.loading.update(move.dst_slots)
        return self._submit(move, urgent=True)

    def _submit(self, move: Move, urgent: bool) -> Move:
        move.job = Job(lambda: self.mover.execute(move), urgent, after=self.worker.compute_event())
        move.submitted = time.perf_counter()
        self.moves[move.job] = move
        self.worker.submit(move.job)
        return move

    def wait(self, move: Move) -> None:
        started = time.perf_counter()
        self.worker.wait(move.job)
        self.stats.wait_s += time.perf_counter() - started
        self.collect()

    def collect(self) -> None:
        """Complete (or roll back) every transfer the worker finished."""
        for job in self.worker.finished():
            move = self.moves.pop(job, None)
            if move is None:
                continue
            if job.error is not None and move.kind == "store":
                self._rollback_store(move, job.error)
                continue
            if job.error is not None:
                log.warning("loading KV blocks failed (%s); they are recomputed", job.error)
                move.failed = list(range(len(move.entries)))
            (self._complete_store if move.kind == "store" else self._complete_load)(move)

    def _unpin_device(self, block: int) -> None:
        count = self.device_pins[block] - 1
        if count:
            self.device_pins[block] = count
        else:
            del self.device_pins[block]
        self.pool.free([block])

    def _release_source(self, entry: Entry, move: Move, drop: bool) -> None:
        if move.src is Tier.DEVICE:
            self._unpin_device(entry.device)
            if drop and self.pool.is_idle(entry.device):
                self.drop(entry, Tier.DEVICE)  # unless a request took the block meanwhile
            else:
                self.settle(entry)
        elif drop:
            self.drop(entry, move.src)
        else:
            self.policies[move.src].insert(entry, self.step, entry.priority)

    def _complete_store(self, move: Move) -> None:
        nbytes = len(move.entries) * self.codec.nbytes
        if move.reason == "persist":
            self.stats.persisted_blocks += len(move.entries)
            self.stats.persist_bytes += nbytes
        else:
            self.stats.spilled_blocks += len(move.entries)
            self.stats.spill_bytes += nbytes
            self.stats.spill_latency.observe(time.perf_counter() - move.submitted)
            self.stats.transfer_s += move.job.seconds
        for entry, slot in zip(move.entries, move.dst_slots):
            entry.busy = None
            setattr(entry, move.dst.value, slot)
            self.policies[move.dst].insert(entry, self.step, entry.priority)
            self._release_source(entry, move, move.drop_source)

    def _rollback_store(self, move: Move, error: BaseException) -> None:
        if move.dst is Tier.DISK:
            self.stats.disk_errors += 1
            if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
                capacity = self.disk.shrink_to_file()
                self._warn_once("disk-full", "KV cache disk is full (%s); the disk tier keeps its %d blocks "
                                "and what does not fit is recomputed when needed", self.disk.dir, capacity)
            else:
                self._warn_once("disk-error", "writing KV blocks to %s failed: %s", self.disk.dir, error)
        else:
            log.warning("storing KV blocks to the %s tier failed: %s", move.dst.value, error)
        for entry, slot in zip(move.entries, move.dst_slots):
            entry.busy = None
            self.store_of(move.dst).release(slot)
            # A spill whose room is needed now drops the block: it is recomputed when wanted.
            self._release_source(entry, move, move.drop_source and move.job.urgent)

    def _complete_load(self, move: Move) -> None:
        self.stats.restore_latency.observe(time.perf_counter() - move.submitted)
        self.stats.restore_bytes += (len(move.entries) - len(move.failed)) * self.codec.nbytes
        self.stats.transfer_s += move.job.seconds
        self.loading.difference_update(move.dst_slots)
        for i, (entry, block) in enumerate(zip(move.entries, move.dst_slots)):
            entry.busy = None
            if i in move.failed:
                self.stats.recomputes += 1
                if entry.where(move.src) is not None:
                    self.drop(entry, move.src)
                continue
            self.policies[move.src].insert(entry, self.step, entry.priority)
            if not move.private[i] and entry.device is None:
                self.attach(entry, block)
        self.landed.append(move)

    # --- once per step ---------------------------------------------------------------------------
    def poll(self) -> None:
        """Complete finished transfers; apply the watermarks and the available-memory floor."""
        self.step += 1
        if self.moves:
            self.collect()
        if self.has_lower_tier:
            self._check_memory()
            self.relieve_device()
            if self.host is not None:
                self._relieve_host()

    def relieve_device(self) -> list[Entry]:
        """Above the high watermark of device blocks holding content, spill idle ones down to the low
        one (without a lower tier, idle blocks wait to be reclaimed). Returns the entries moved."""
        policy = self.policies[Tier.DEVICE]
        high = self.config.high_watermark * self.pool.num_blocks
        if not len(policy) or not self.has_lower_tier or self.pool.num_blocks - self.pool.num_blank <= high:
            return []  # the last test bounds ``used`` from above without counting the pins (every step)
        used = self.pool.num_blocks - self.pool.num_blank - self.pinned_only()
        if used <= high:
            return []
        excess = used - math.floor(self.config.low_watermark * self.pool.num_blocks)
        victims = policy.evict(min(excess, len(policy)), self.step)
        self.spill(victims, urgent=False, lose_unplaced=False)
        return victims

    def _relieve_host(self) -> None:
        """Above the high watermark (with a disk to go to), shrink the host tier to the low one; while
        available memory is under the floor, shrink it by the same ratio at every check."""
        host, policy = self.host, self.policies[Tier.HOST]
        if self.floor_breached:
            target = math.floor(self.config.low_watermark * host.num_used)
        elif self.disk is not None and host.num_used > self.config.high_watermark * host.capacity:
            target = math.floor(self.config.low_watermark * host.capacity)
        else:
            return
        for entry in policy.evict(min(len(policy), host.num_used - target), self.step):
            if entry.disk is None and entry.device is None and (slot := self.reserve(Tier.DISK)) is not None:
                self.start_store([entry], Tier.HOST, Tier.DISK, [slot], drop_source=True, reason="spill",
                                 urgent=False)
            else:
                self.drop(entry, Tier.HOST)

    def _check_memory(self) -> None:
        if not self.config.available_floor_mb:
            return
        now = self._clock()
        if now < self._next_memory_check:
            return
        self._next_memory_check = now + self.config.memory_check_s
        breached = self._available_memory() < self.config.available_floor_mb * 2**20
        if breached and not self.floor_breached:
            self.stats.floor_events += 1
            log.warning("available memory is under the profile's floor of %d MiB: the host KV tier shrinks "
                        "and new spills go to disk", self.config.available_floor_mb)
        self.floor_breached = breached

    def spill_idle(self, to: str | None = None) -> int:
        """Move idle blocks down now and wait for it; returns the blocks stored.

        ``None`` applies the watermarks; ``"host"`` moves every idle device block to the host
        tier; ``"disk"`` moves every idle block of the device and the host tier to disk.
        """
        self.drain()  # blocks busy with a transfer are not candidates: let those finish first
        if to is None:
            before = self.stats.spilled_blocks
            self.relieve_device()
            self.drain()
            return self.stats.spilled_blocks - before
        tier = Tier(to)
        if tier is Tier.DEVICE or self.store_of(tier) is None:
            raise ValueError(f"there is no {to!r} tier to spill to")
        policy = self.policies[Tier.DEVICE]
        moved = self.spill(policy.evict(len(policy), self.step), urgent=True, lose_unplaced=False, only=tier)
        self.drain()
        if tier is Tier.DISK and self.host is not None:
            moved += self._demote_host()
        return moved

    def _demote_host(self) -> int:
        policy, moved = self.policies[Tier.HOST], 0
        for entry in policy.evict(len(policy), self.step):
            if entry.disk is not None:
                self.drop(entry, Tier.HOST)
            elif (slot := self.reserve(Tier.DISK)) is not None:
                self.start_store([entry], Tier.HOST, Tier.DISK, [slot], drop_source=True, reason="spill",
                                 urgent=True)
                moved += 1
            else:
                policy.insert(entry, self.step, entry.priority)
        self.drain()
        return moved

    def drain(self) -> None:
        self.worker.drain()
        self.collect()

    # --- vision outputs --------------------------------------------------------------------------
    def load_embedding(self, image_hash: str) -> torch.Tensor | None:
        return None if self.embeddings is None else self.embeddings.get(image_hash)

    def store_embedding(self, image_hash: str, embeds: torch.Tensor) -> None:
        files = self.embeddings
        if files is None:
            return

        def write() -> None:
            try:
                files.put(image_hash, embeds)
            except OSError as error:
                self._warn_once("vision-disk", "cannot write the vision cache to %s: %s", files.dir, error)

        self.worker.submit(Job(write, urgent=False, after=self.worker.compute_event()))

    # --- reporting -------------------------------------------------------------------------------
    def tier_states(self, tier: Tier) -> dict[str, int]:
        store = self.store_of(tier)
        entries = [e for e in self.index.entries() if e.where(tier) is not None]
        busy = sum(1 for e in entries if e.busy is not None)
        preempted = sum(1 for e in entries if e.busy is None and e.pins)
        reserved = store.num_used - len(entries)  # destinations of stores in flight
        return {"idle": len(entries) - busy - preempted, "preempted": preempted, "busy": busy + reserved,
                "free": store.capacity - store.num_used}

    def device_states(self) -> dict[str, int]:
        pool = self.pool
        storing, loading = self.pinned_only(), len(self.loading)
        return {"running": pool.num_blocks - pool.num_free - storing - loading, "idle": pool.num_idle,
                "storing": storing, "loading": loading, "free": pool.num_blank}

    def flush(self, write_through: bool) -> None:
        """Finish every transfer and, with ``write_through``, write to disk what only memory holds."""
        self.drain()
        if self.disk is not None and write_through:
            self.persist([e for e in self.index.entries() if e.disk is None and e.busy is None])
            self.drain()

    def shutdown(self, write_through: bool) -> None:
        """Flush, stop the worker, release the cache folder. Runs once: from ``close``, when the
        manager is collected, or at interpreter exit."""
        if self._shut:
            return
        self._shut = True
        try:
            self.flush(write_through)
        finally:
            self.worker.close()
            self.collect()
            if self.disk is not None:
                self.disk.close()


def disk_layout(fingerprint: bytes, codec: BlockCodec, geometry: BlockGeometry) -> DiskLayout:
    return DiskLayout(fingerprint.hex(), codec.name, geometry.describe(), codec.nbytes)
