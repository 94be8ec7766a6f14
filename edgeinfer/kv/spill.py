"""The spill manager: where each cached block lives, and the mechanism that moves it between tiers.

It owns the host and disk tiers and the spill worker it is given, one eviction policy per
tier (the entries that may leave that tier) and the transfers in flight. It decides which
blocks go (the policies) and how; never *when* to spill ahead of need: the KV manager
asks, applying the rules of :mod:`edgeinfer.kv.pressure`. The only rule it reads is the
memory floor's state: under the floor the host tier takes no new spills.

Candidates: on the device, idle entries (their block is cached but nobody owns it); on
the host and the disk, every entry there that no transfer is using.

Transfers are two-phase. A :class:`~edgeinfer.kv.entry.Move` is *prepared* here on the
engine's thread (destination reserved, device sources referenced, entries busy), runs on
the worker (:class:`~edgeinfer.kv.transfer.Mover`), and is *completed* or *rolled back*
here, on the engine's thread, in ``collect``.
"""

from __future__ import annotations

import logging
import time

from edgeinfer.errors import CapacityError
from edgeinfer.kv.codec import BlockCodec
from edgeinfer.kv.disk import FULL_ERRNOS, DiskStore
from edgeinfer.kv.entry import Entry, Move, MoveKind, PrefixIndex, Tier
from edgeinfer.kv.host import HostStore
from edgeinfer.kv.metrics import KVStats, TierUsage
from edgeinfer.kv.policy import EvictionPolicy
from edgeinfer.kv.pool import BlockPool, KVCache
from edgeinfer.kv.pressure import MemoryFloor
from edgeinfer.kv.transfer import Mover
from edgeinfer.kv.worker import Job, SpillWorker

log = logging.getLogger(__name__)


class SpillManager:
    def __init__(self, pool: BlockPool, cache: KVCache, codec: BlockCodec, index: PrefixIndex, *,
                 policies: dict[Tier, EvictionPolicy], host: HostStore | None, disk: DiskStore | None,
                 worker: SpillWorker, pin_host: bool, floor: MemoryFloor, stats: KVStats) -> None:
        self.pool = pool
        self.cache = cache
        self.codec = codec
        self.index = index
        self.host = host
        self.disk = disk
        self.worker = worker
        self.stats = stats
        self._policies = policies
        self._floor = floor  # read here, updated by the KV manager
        self._mover = Mover(cache, codec, host, disk, pin_host)
        self._moves: dict[Job, Move] = {}
        self._landed: list[Move] = []  # completed restores, for the KV manager to settle
        self._device_pins: dict[int, int] = {}  # device block -> stores reading it
        self._loading: set[int] = set()  # device blocks being written by restores
        self._step = 0
        self._warned: set[str] = set()
        self._shut = False
        self._adopt_disk_records()

    # --- tiers -------------------------------------------------------------------------------
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
            self._policies[Tier.DISK].insert(entry, 0, entry.priority)

    @property
    def has_lower_tier(self) -> bool:
        return self.host is not None or self.disk is not None

    def store_of(self, tier: Tier) -> HostStore | DiskStore | None:
        return self.host if tier is Tier.HOST else self.disk

    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    def tick(self) -> None:
        """One engine step passed (the policies' clock); complete the transfers that finished."""
        self._step += 1
        if self._moves:
            self.collect()

    # --- device copies and candidates ------------------------------------------------------------
    def attach(self, entry: Entry, block: int) -> None:
        """``block`` now holds ``entry``'s content (cached: it stays when its owners free it)."""
        entry.place(Tier.DEVICE, block)
        self.pool.mark_cached(block)
        self.index.on_device[block] = entry

    def take(self, entry: Entry) -> None:
        """One more reference to an entry's device block."""
        if self.pool.is_idle(entry.device):
            self._policies[Tier.DEVICE].remove(entry)
        self.pool.revive(entry.device)
        self._touch(entry)

    def _touch(self, entry: Entry) -> None:
        for tier in Tier:
            if entry.where(tier) is not None:
                self._policies[tier].touch(entry, self._step)

    def settle(self, entry: Entry) -> None:
        """After a reference to its block was dropped: an idle block becomes a candidate."""
        if entry.device is not None and self.pool.is_idle(entry.device) and entry.busy is None:
            self._policies[Tier.DEVICE].insert(entry, self._step, entry.priority)

    def reprioritize(self, entry: Entry) -> None:
        """The entry's pins changed: where it is a candidate, it is one at its new priority."""
        for tier in Tier:
            if entry in self._policies[tier]:
                self._policies[tier].insert(entry, self._step, entry.priority)

    def withdraw(self, entries: list[Entry], tier: Tier) -> None:
        """Entries that must stay in ``tier`` for now (about to be restored from it)."""
        for entry in entries:
            self._policies[tier].remove(entry)

    def _drop(self, entry: Entry, tier: Tier) -> None:
        """Forget ``entry``'s copy in ``tier`` (the entry is not busy; a device copy is idle)."""
        self._policies[tier].remove(entry)
        where = entry.where(tier)
        if tier is Tier.DEVICE:
            del self.index.on_device[where]
            self.pool.uncache(where)
        else:
            self.store_of(tier).release(where)
        entry.place(tier, None)
        if not entry.located:
            self.index.forget(entry)
            self.stats.lost_blocks += entry.pins > 0

    # --- room ----------------------------------------------------------------------------------
    def spill_only(self, block: int) -> bool:
        """Only a spill in flight holds device ``block``: it is blank once the spill completes."""
        pins = self._device_pins.get(block, 0)
        return pins > 0 and self.pool.refcount(block) == pins

    def pinned_only(self) -> int:
        """Device blocks only a spill in flight holds: blank once it completes."""
        return sum(1 for b in list(self._device_pins) if self.spill_only(b))

    @property
    def idle_candidates(self) -> int:
        """Idle device blocks the policy may give up."""
        return len(self._policies[Tier.DEVICE])

    def reclaimable(self) -> int:
        return self.idle_candidates + self.pinned_only()

    def reclaim(self, n: int) -> None:
        """Make ``n`` blank device blocks, spilling or dropping idle ones; waits for spills it needs.

        Atomic: when even every candidate would not make room, it raises CapacityError before
        giving any up."""
        if n > self.pool.num_blank + self.reclaimable():
            raise CapacityError(f"KV pool has {self.pool.num_blank} free blocks and {self.reclaimable()} "
                                f"it can free, {n} needed")
        while self.pool.num_blank < n:
            policy = self._policies[Tier.DEVICE]
            short = n - self.pool.num_blank
            victims = policy.evict(min(short, len(policy)), self._step) if len(policy) else []
            if not victims:
                spills = [m for m in self._moves.values() if m.src is Tier.DEVICE]
                if not spills:
                    raise CapacityError(f"KV pool has {self.pool.num_blank} free blocks, {n} needed")
                self.wait(spills[0])
                continue
            if self.spill(victims, urgent=True, lose_unplaced=True):
                for move in [m for m in self._moves.values() if m.src is Tier.DEVICE and m.job.urgent]:
                    self.wait(move)

    def spill(self, entries: list[Entry], urgent: bool, lose_unplaced: bool, only: Tier | None = None) -> int:
        """Store idle device entries to the host (or the disk, or ``only`` there) and drop them from
        the device when done; an entry that already has a copy there is dropped now. Entries with
        nowhere to go are dropped now (``lose_unplaced``: their room is needed) or stay idle on the
        device. Returns how many are being stored."""
        lower = (only,) if only else (Tier.HOST, Tier.DISK)
        for entry in entries:  # a copy below already: the device copy just goes
            if any(entry.where(tier) is not None for tier in lower):
                self._drop(entry, Tier.DEVICE)
        entries = [e for e in entries if e.device is not None]
        if not entries:
            return 0
        self.withdraw(entries, Tier.DEVICE)
        to_host, to_disk = self._destinations(entries, only)
        for tier, items in ((Tier.HOST, to_host), (Tier.DISK, to_disk)):
            if items:
                self._start_store([e for e, _ in items], Tier.DEVICE, tier, [s for _, s in items],
                                  MoveKind.SPILL, urgent=urgent)
        placed = {id(e) for e, _ in to_host + to_disk}
        for entry in entries:
            if id(entry) in placed:
                continue
            if lose_unplaced:
                self._drop(entry, Tier.DEVICE)
            else:
                self.settle(entry)
        return len(placed)

    def spill_coldest(self, n: int) -> list[Entry]:
        """Spill up to ``n`` idle device entries, least valuable first, in the background; those
        with nowhere to go stay idle. Returns the entries the policy gave up."""
        policy = self._policies[Tier.DEVICE]
        victims = policy.evict(min(n, len(policy)), self._step)
        self.spill(victims, urgent=False, lose_unplaced=False)
        return victims

    def shrink_host(self, n: int) -> None:
        """Push up to ``n`` host entries out, least valuable first: to disk in the background when
        that is their only other copy and the disk has room, else they are dropped (the memory
        is what is wanted)."""
        policy = self._policies[Tier.HOST]
        for entry in policy.evict(min(len(policy), n), self._step):
            if entry.disk is None and entry.device is None and (slot := self._reserve(Tier.DISK)) is not None:
                self._start_store([entry], Tier.HOST, Tier.DISK, [slot], MoveKind.SPILL, urgent=False)
            else:
                self._drop(entry, Tier.HOST)

    def spill_all(self, tier: Tier) -> int:
        """Move every idle device block to ``tier`` now, and for the disk every host block too, and
        wait for it; returns the blocks stored."""
        if tier is Tier.DEVICE or self.store_of(tier) is None:
            raise ValueError(f"there is no {tier.value!r} tier to spill to")
        policy = self._policies[Tier.DEVICE]
        moved = self.spill(policy.evict(len(policy), self._step), urgent=True, lose_unplaced=False, only=tier)
        self.drain()
        if tier is Tier.DISK and self.host is not None:
            moved += self._demote_host()
        return moved

    def _demote_host(self) -> int:
        policy, moved = self._policies[Tier.HOST], 0
        for entry in policy.evict(len(policy), self._step):
            if entry.disk is not None:
                self._drop(entry, Tier.HOST)
            elif (slot := self._reserve(Tier.DISK)) is not None:
                self._start_store([entry], Tier.HOST, Tier.DISK, [slot], MoveKind.SPILL, urgent=True)
                moved += 1
            else:
                policy.insert(entry, self._step, entry.priority)
        self.drain()
        return moved

    def _destinations(self, entries: list[Entry], only: Tier | None
                      ) -> tuple[list[tuple[Entry, int]], list[tuple[Entry, int]]]:
        """Slots for ``entries``: the host tier first (not while memory is under the floor), then disk."""
        to_host, to_disk = [], []
        use_host = only in (None, Tier.HOST) and not self._floor.breached
        use_disk = only in (None, Tier.DISK)
        for entry in entries:
            slot = self._reserve(Tier.HOST) if use_host else None
            if slot is not None:
                to_host.append((entry, slot))
            elif use_disk and (slot := self._reserve(Tier.DISK)) is not None:
                to_disk.append((entry, slot))
        return to_host, to_disk

    def _reserve(self, tier: Tier) -> int | None:
        """A free slot in ``tier``, evicting its least valuable entry when it is full."""
        store = self.store_of(tier)
        if store is None or not store.writable:  # a read-only tier keeps what it has
            return None
        slot = store.reserve()
        if slot is None:
            victims = self._policies[tier].evict(1, self._step)
            if victims:
                self._drop(victims[0], tier)
                slot = store.reserve()
        return slot

    def persist(self, entries: list[Entry]) -> None:
        """Write entries through to disk in the background, keeping their other copies."""
        if self.disk is None:
            return
        for tier in (Tier.DEVICE, Tier.HOST):
            items = [(e, s) for e in entries if e.where(tier) is not None and e.busy is None and e.disk is None
                     and (s := self._reserve(Tier.DISK)) is not None]
            if items:
                self._start_store([e for e, _ in items], tier, Tier.DISK, [s for _, s in items],
                                  MoveKind.PERSIST, urgent=False)

    # --- transfers: prepare ----------------------------------------------------------------------
    def _start_store(self, entries: list[Entry], src: Tier, dst: Tier, slots: list[int], kind: MoveKind, *,
                     urgent: bool) -> Move:
        move = Move(kind, src, dst, entries, [e.where(src) for e in entries], slots)
        for entry in entries:
            self._policies[src].remove(entry)
            if src is Tier.DEVICE:
                self.pool.revive(entry.device)
                self._device_pins[entry.device] = self._device_pins.get(entry.device, 0) + 1
            entry.busy = move
        return self._submit(move, urgent)

    def start_load(self, seq_id: int, src: Tier, items: list[tuple[Entry, int, bool]]) -> Move:
        """Restore (entry, device block, private) triples from ``src``; private blocks belong to the
        sequence. An entry's copy in the other lower tier stays a candidate there."""
        entries = [e for e, _, _ in items]
        move = Move(MoveKind.RESTORE, src, Tier.DEVICE, entries, [e.where(src) for e in entries],
                    [b for _, b, _ in items], private=[p for _, _, p in items], seq_id=seq_id)
        other = Tier.DISK if src is Tier.HOST else Tier.HOST
        for entry in entries:
            self._policies[src].remove(entry)
            entry.busy = move
            if entry.where(other) is not None:
                self._policies[other].insert(entry, self._step, entry.priority)
        self._loading.update(move.dst_slots)
        return self._submit(move, urgent=True)

    def _submit(self, move: Move, urgent: bool) -> Move:
        move.job = Job(lambda: self._mover.execute(move), urgent, after=self.worker.compute_event())
        move.submitted = time.perf_counter()
        self._moves[move.job] = move
        self.worker.submit(move.job)
        return move

    # --- transfers: complete or roll back ------------------------------------------------------------
    def wait(self, move: Move) -> None:
        started = time.perf_counter()
        self.worker.wait(move.job)
        self.stats.wait_s += time.perf_counter() - started
        self.collect()

    def drain(self) -> None:
        self.worker.drain()
        self.collect()

    def collect(self) -> None:
        """Complete (or roll back) every transfer the worker finished."""
        for job in self.worker.finished():
            move = self._moves.pop(job, None)
            if move is None:
                continue
            if job.error is not None and move.kind.is_store:
                self._rollback_store(move, job.error)
                continue
            if job.error is not None:
                log.warning("loading KV blocks failed (%s); they are recomputed", job.error)
                move.failed = list(range(len(move.entries)))
            (self._complete_store if move.kind.is_store else self._complete_load)(move)

    @property
    def in_flight(self) -> bool:
        """Transfers were started and not yet completed here (finished on the worker or not)."""
        return bool(self._moves)

    def take_landed(self) -> list[Move]:
        """Restores completed since the last call (their ``failed`` says which blocks did not arrive)."""
        landed, self._landed = self._landed, []
        return landed

    def _unpin_device(self, block: int) -> None:
        count = self._device_pins[block] - 1
        if count:
            self._device_pins[block] = count
        else:
            del self._device_pins[block]
        self.pool.free([block])

    def _release_source(self, entry: Entry, move: Move, drop: bool) -> None:
        if move.src is Tier.DEVICE:
            self._unpin_device(entry.device)
            if drop and self.pool.is_idle(entry.device):
                self._drop(entry, Tier.DEVICE)  # unless a request took the block meanwhile
            else:
                self.settle(entry)
        elif drop:
            self._drop(entry, move.src)
        else:
            self._policies[move.src].insert(entry, self._step, entry.priority)

    def _complete_store(self, move: Move) -> None:
        nbytes = len(move.entries) * self.codec.nbytes
        if move.kind is MoveKind.PERSIST:
            self.stats.persisted_blocks += len(move.entries)
            self.stats.persist_bytes += nbytes
        else:
            self.stats.spilled_blocks += len(move.entries)
            self.stats.spill_bytes += nbytes
            self.stats.spill_latency.observe(time.perf_counter() - move.submitted)
            self.stats.transfer_s += move.job.seconds
        for entry, slot in zip(move.entries, move.dst_slots):
            entry.busy = None
            entry.place(move.dst, slot)
            self._policies[move.dst].insert(entry, self._step, entry.priority)
            self._release_source(entry, move, move.kind.drops_source)

    def _rollback_store(self, move: Move, error: BaseException) -> None:
        if move.dst is Tier.DISK:
            self.stats.disk_errors += 1
            if isinstance(error, OSError) and error.errno in FULL_ERRNOS:
                self._warn_once("disk-full", "KV cache disk is full (%s: %s); the disk tier keeps reading its %d "
                                "blocks and stops writing, what does not fit is recomputed when needed",
                                self.disk.dir, error, len(self.disk.records))
            else:
                self._warn_once("disk-error", "writing KV blocks to %s failed: %s", self.disk.dir, error)
        else:
            log.warning("storing KV blocks to the %s tier failed: %s", move.dst.value, error)
        for entry, slot in zip(move.entries, move.dst_slots):
            entry.busy = None
            self.store_of(move.dst).release(slot)
            # A spill whose room is needed now drops the block: it is recomputed when wanted.
            self._release_source(entry, move, move.kind.drops_source and move.job.urgent)

    def _complete_load(self, move: Move) -> None:
        self.stats.restore_latency.observe(time.perf_counter() - move.submitted)
        self.stats.restore_bytes += (len(move.entries) - len(move.failed)) * self.codec.nbytes
        self.stats.transfer_s += move.job.seconds
        self._loading.difference_update(move.dst_slots)
        for i, (entry, block) in enumerate(zip(move.entries, move.dst_slots)):
            entry.busy = None
            if i in move.failed:
                self.stats.recomputes += 1
                if entry.where(move.src) is not None:
                    self._drop(entry, move.src)
                continue
            self._policies[move.src].insert(entry, self._step, entry.priority)
            if not move.private[i] and entry.device is None:
                self.attach(entry, block)
        self._landed.append(move)

    # --- reporting -------------------------------------------------------------------------------
    def tier_usage(self) -> dict[str, TierUsage]:
        """Capacity and blocks by state of each tier (a snapshot; safe to take from another thread)."""
        nbytes = self.codec.nbytes
        usage = {Tier.DEVICE.value: TierUsage(self.pool.num_blocks, self._device_states(), nbytes)}
        for tier in (Tier.HOST, Tier.DISK):
            store = self.store_of(tier)
            if store is not None:
                # A tier that stopped writing (a full disk) has no free slots: its capacity is what it holds.
                capacity = store.capacity if store.writable else store.num_used
                usage[tier.value] = TierUsage(capacity, self._tier_states(tier, store, capacity), nbytes)
        return usage

    def _tier_states(self, tier: Tier, store: HostStore | DiskStore, capacity: int) -> dict[str, int]:
        entries = [e for e in self.index.entries() if e.where(tier) is not None]
        busy = sum(1 for e in entries if e.busy is not None)
        preempted = sum(1 for e in entries if e.busy is None and e.pins)
        reserved = store.num_used - len(entries)  # destinations of stores in flight
        return {"idle": len(entries) - busy - preempted, "preempted": preempted, "busy": busy + reserved,
                "free": capacity - store.num_used}

    def _device_states(self) -> dict[str, int]:
        pool = self.pool
        storing, loading = self.pinned_only(), len(self._loading)
        return {"running": pool.num_blocks - pool.num_free - storing - loading, "idle": pool.num_idle,
                "storing": storing, "loading": loading, "free": pool.num_blank}

    def problems(self) -> list[str]:
        """Where the candidates, pins and slots disagree with the entries (empty when they agree)."""
        entries, problems = self.index.entries(), []
        for entry in entries:
            for tier in Tier:
                where, listed = entry.where(tier), entry in self._policies[tier]
                free = entry.busy is None or tier not in (entry.busy.src, entry.busy.dst)
                candidate = where is not None and free and (tier is not Tier.DEVICE or self.pool.is_idle(where))
                if listed != candidate:
                    problems.append(f"entry in {tier.value} slot {where}: candidate {candidate}, listed {listed}")
        if self._moves:
            return problems
        if self._device_pins or self._loading:
            problems.append(f"pins {self._device_pins} or loads {self._loading} without transfers")
        for tier in (Tier.HOST, Tier.DISK):
            store = self.store_of(tier)
            held = sum(1 for e in entries if e.where(tier) is not None)
            if store is not None and store.num_used != held:
                problems.append(f"{tier.value} tier has {store.num_used} slots in use, entries hold {held}")
        return problems

    # --- the end ---------------------------------------------------------------------------------
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
