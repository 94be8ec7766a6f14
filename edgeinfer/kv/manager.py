"""The KV manager: the one object the scheduler and the engine ask about KV blocks.

It gives sequences their blocks and their keys, and applies the spill pressure rules
(:mod:`edgeinfer.kv.pressure`) once per step; the :class:`SpillManager` under it knows
where each cached block lives and moves it between tiers, through its public methods
only. Callers see a small API:

- ``can_admit(seq, chunk)`` / ``admit(seq, chunk)``: place a waiting sequence. Its
  prompt (or, after a preemption, everything it had cached) is matched against the
  prefix cache; blocks on the device are shared, blocks on the host or the disk are
  loaded by the worker; ``ready(seq)`` says when they are all there.
- ``can_allocate(n)`` / ``allocate_for(seq, n)``: more blocks for a running sequence,
  blank ones or idle ones the policy gives up.
- ``preempt(seq)``: spill a running sequence whole; ``admit`` restores it later.
- ``free(seq)``: a finished sequence's blocks stay in the prefix cache (idle).
- ``note_progress(seq)``: blocks that just filled get their keys (shareable at once).
- ``poll()``: once per engine step; ``collect()`` between steps, on an idle engine (so its
  metrics settle once the last write-through lands). ``metrics()``: a snapshot.
  ``close()``: drain, flush.
- ``embeddings``: the vision outputs on disk (an :class:`EmbeddingStore`, None without a
  disk tier), the lower level of the engine's vision cache.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


from edgeinfer.kv.codec import BlockCodec, BlockGeometry, make_codec
from edgeinfer.kv.disk import DiskLayout, DiskStore, default_cache_dir, open_disk_tier
from edgeinfer.kv.embeddings import EmbeddingStore
from edgeinfer.kv.entry import Entry, Move, PrefixIndex, Tier
from edgeinfer.kv.hashing import (
    BlockKey,
    ImageSpan,
    full_key,
    image_ends_in,
    partial_key,
)
from edgeinfer.kv.host import HostStore
from edgeinfer.kv.metrics import KVMetrics, KVStats
from edgeinfer.kv.policy import make_policy
from edgeinfer.kv.pool import BlockPool, BlockTable, KVCache
from edgeinfer.kv.pressure import MemoryFloor, Watermarks
from edgeinfer.kv.spill import SpillManager
from edgeinfer.kv.worker import SpillWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVManagerConfig:
    """The KV tiers' settings, from the profile's ``memory`` and ``kv`` sections."""

    host_precision: str = "full"
    host_tier_mb: int = 0
    disk_tier_mb: int = 0
    disk_dir: str | None = None  # None: default_cache_dir()
    disk_free_margin_mb: int | None = None  # free space the disk tier never takes; None: 5% of the filesystem
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    available_floor_mb: int = 0
    policy: str = "lru-k"
    prefix_cache: bool = True
    write_through: bool = True  # finished requests' blocks also go to disk (in the background)
    pin_host: bool = False  # pinned host tier (a discrete GPU)
    memory_check_s: float = 0.25

    def __post_init__(self) -> None:
        Watermarks(self.high_watermark, self.low_watermark)  # raises on watermarks out of order
        for name in ("host_tier_mb", "disk_tier_mb", "available_floor_mb", "disk_free_margin_mb"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0")


class KVSequence(Protocol):
    """What the manager reads of a sequence (the engine's ``Sequence`` fits)."""

    seq_id: int
    prompt_ids: list[int]
    generated: list[int]
    block_table: BlockTable
    image_spans: tuple[ImageSpan, ...]
    prefix_tokens_reused: int
    spilled_blocks: int
    restored_blocks: int
    recomputed_blocks: int

    @property
    def prefill_target(self) -> int: ...


@dataclass(slots=True)
class _Admission:
    """What an admission planned to reuse; counted once its loads have landed, so a block that
    failed its checksum is reported as recomputed, never as reused."""

    tokens: int  # tokens the plan covers
    lookup: int  # tokens that were looked up
    loaded: set[int]  # device blocks the loads fill
    restore: bool  # a preempted sequence coming back: its prefix was counted when it was first admitted
    failed: set[int] = field(default_factory=set)  # loaded blocks whose bytes did not arrive


@dataclass(slots=True)
class _SeqState:
    seq: KVSequence
    keys: list[BlockKey] = field(default_factory=list)  # keys of the full blocks computed so far
    registered: int = 0  # table blocks already looked at for registration
    moves: list[Move] = field(default_factory=list)  # loads the sequence waits for
    pinned: list[Entry] = field(default_factory=list)  # entries kept for it while it is preempted
    admission: _Admission | None = None  # placed, its loads not all landed yet
    preempted: bool = False
    placed: bool = False


@dataclass(frozen=True, slots=True)
class _Plan:
    reuse: list[Entry]  # full entries, in order
    partial: tuple[Entry, int] | None  # copy the first j tokens of this entry
    tokens: int  # tokens the plan covers
    lookup: int  # tokens that were looked up

    def new_blocks(self) -> int:
        return sum(e.device is None for e in self.reuse) + (self.partial is not None)

    def taken(self) -> list[Entry]:
        return self.reuse + ([self.partial[0]] if self.partial else [])


def _available_memory() -> int:
    import psutil

    return psutil.virtual_memory().available


def _host_tier(config: KVManagerConfig, codec: BlockCodec) -> HostStore | None:
    capacity = config.host_tier_mb * 2**20 // codec.nbytes
    return HostStore(capacity, codec.nbytes, pin=config.pin_host) if capacity else None


def _disk_tier(config: KVManagerConfig, layout: DiskLayout) -> DiskStore | None:
    capacity = config.disk_tier_mb * 2**20 // layout.nbytes
    if not capacity:
        return None
    root = Path(config.disk_dir).expanduser() if config.disk_dir else default_cache_dir()
    margin = None if config.disk_free_margin_mb is None else config.disk_free_margin_mb * 2**20
    return open_disk_tier(root, layout, capacity, margin)


def disk_layout(fingerprint: bytes, codec: BlockCodec, geometry: BlockGeometry) -> DiskLayout:
    return DiskLayout(fingerprint.hex(), codec.name, geometry.describe(), codec.nbytes)


class KVManager:
    def __init__(self, pool: BlockPool, cache: KVCache, config: KVManagerConfig = KVManagerConfig(),
                 fingerprint: BlockKey = b"\0" * 16, *,
                 available_memory: Callable[[], int] = _available_memory,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.cache = cache
        self.config = config
        self.block_size = pool.block_size
        self.root = fingerprint
        self.clock = clock  # when the memory floor is read
        self._available_memory = available_memory
        self.watermarks = Watermarks(config.high_watermark, config.low_watermark)
        self.floor = MemoryFloor(config.available_floor_mb, config.memory_check_s)
        self.stats = KVStats()
        policies = {tier: make_policy(config.policy) for tier in Tier}  # an unknown name fails before any tier opens
        layers, _, bs, kvh, hd = cache.k.shape
        geometry = BlockGeometry(layers, bs, kvh, hd, cache.k.dtype)
        self.codec = make_codec(config.host_precision, geometry, cache.device)
        self.index = PrefixIndex(self.block_size)
        worker = SpillWorker(cache.device)
        disk = _disk_tier(config, disk_layout(fingerprint, self.codec, geometry))
        self.embeddings = None if disk is None else EmbeddingStore(
            disk.dir / "vision", worker, owner=disk.layout.fingerprint, free_space=disk.free_space)
        self.spill = SpillManager(pool, cache, self.codec, self.index, policies=policies,
                                  host=_host_tier(config, self.codec), disk=disk, worker=worker,
                                  pin_host=config.pin_host, floor=self.floor, stats=self.stats)
        self._seqs: dict[int, _SeqState] = {}
        # A short-lived engine (``edgeinfer run``) is collected, not closed: flush then, or at exit.
        self._finalizer = weakref.finalize(self, self.spill.shutdown, config.write_through)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    # --- keys ----------------------------------------------------------------------------------
    def _state(self, seq: KVSequence) -> _SeqState:
        state = self._seqs.get(seq.seq_id)
        if state is None:
            state = self._seqs[seq.seq_id] = _SeqState(seq)
        return state

    @staticmethod
    def _tokens(seq: KVSequence, start: int, end: int) -> list[int]:
        n = len(seq.prompt_ids)
        if end <= n:
            return seq.prompt_ids[start:end]
        return (seq.prompt_ids[start:] if start < n else []) + seq.generated[max(0, start - n):end - n]

    def _keys(self, state: _SeqState, n_full: int) -> list[BlockKey]:
        """Keys of the sequence's first ``n_full`` full blocks (extends the cached chain)."""
        bs, keys, seq = self.block_size, state.keys, state.seq
        while len(keys) < n_full:
            start = len(keys) * bs
            parent = keys[-1] if keys else self.root
            keys.append(full_key(parent, self._tokens(seq, start, start + bs), seq.image_spans, start))
        return keys[:n_full]

    def _partial_key(self, state: _SeqState, b: int, j: int) -> BlockKey:
        start = b * self.block_size
        parent = self._keys(state, b)[-1] if b else self.root
        return partial_key(parent, self._tokens(state.seq, start, start + j), state.seq.image_spans, start)

    def _aliases(self, state: _SeqState, b: int, valid: int) -> tuple[tuple[BlockKey, int], ...]:
        """Partial keys inside block ``b`` where an image ends (a question about the same image then
        reuses every image token) and where the prompt ends (a repeated or extended prompt reuses
        all of it but the token it must compute)."""
        start, prompt = b * self.block_size, len(state.seq.prompt_ids)
        ends = set(image_ends_in(state.seq.image_spans, start, start + valid))
        ends.update(j for j in (prompt - 1 - start, prompt - start) if 0 < j < valid)
        return tuple((self._partial_key(state, b, j), j) for j in sorted(ends))

    # --- admission -----------------------------------------------------------------------------
    def _plan(self, state: _SeqState) -> _Plan:
        seq, bs = state.seq, self.block_size
        target = seq.prefill_target
        cap = target if seq.generated else target - 1  # a fresh prompt computes >= 1 token for its logits
        if not self.config.prefix_cache or cap <= 0:
            return _Plan([], None, 0, max(cap, 0))
        reuse: list[Entry] = []
        for key in self._keys(state, cap // bs):
            entry = self.index.full.get(key)
            if entry is None or not entry.usable:
                break
            reuse.append(entry)
        b = len(reuse)
        for j in range(min(bs - 1, cap - b * bs), 0, -1):
            entry = self.index.prefix(self._partial_key(state, b, j), j)
            if entry is not None and entry.usable:
                return _Plan(reuse, (entry, j), b * bs + j, cap)
        return _Plan(reuse, None, b * bs, cap)

    def _chunk_blocks(self, plan: _Plan, seq: KVSequence, chunk: int) -> int:
        placed = len(plan.reuse) + (plan.partial is not None)
        end = min(seq.prefill_target, plan.tokens + chunk)
        return max(0, math.ceil(end / self.block_size) - placed)

    def can_admit(self, seq: KVSequence, chunk: int, spare: int = 0) -> bool:
        """Whether ``admit(seq, chunk)`` finds room for its first chunk and ``spare`` more blocks
        without preempting anyone. No side effects."""
        state = self._state(seq)
        if state.placed:
            return True
        plan = self._plan(state)
        # Reused blocks that ``reclaimable`` counts (idle, or held only by a spill in flight) stop
        # being reclaimable once this sequence takes them.
        revived = sum(1 for e in plan.taken() if e.device is not None
                      and (self.pool.is_idle(e.device) or self.spill.spill_only(e.device)))
        need = plan.new_blocks() + self._chunk_blocks(plan, seq, chunk) + spare
        return need <= self.pool.num_blank + self.spill.reclaimable() - revived

    def admit(self, seq: KVSequence, chunk: int) -> int:
        """Place ``seq``: share or load what the prefix cache holds; returns the tokens reused."""
        state = self._state(seq)
        if state.placed:
            return seq.block_table.num_tokens
        plan = self._plan(state)
        for entry in plan.taken():
            if entry.device is not None:
                self.spill.take(entry)  # the partial source only while it is copied
        to_load = [e for e in plan.taken() if e.device is None]
        for tier in (Tier.HOST, Tier.DISK):
            self.spill.withdraw(to_load, tier)  # making room must not evict what is about to load
        self.spill.reclaim(plan.new_blocks())
        fresh = self.pool.allocate(plan.new_blocks())
        blocks, loads = self._place(plan, fresh)
        seq.block_table.blocks = blocks
        seq.block_table.num_tokens = plan.tokens
        state.registered = len(plan.reuse)
        for tier, items in loads.items():
            if items:
                state.moves.append(self.spill.start_load(seq.seq_id, tier, items))
        self._unpin(state)
        loaded = {block for items in loads.values() for _, block, _ in items}
        state.admission = _Admission(plan.tokens, plan.lookup, loaded, restore=state.preempted)
        state.preempted, state.placed = False, True
        if not state.moves:
            self._close_admission(state)
        return plan.tokens

    def _place(self, plan: _Plan, fresh: list[int]) -> tuple[list[int], dict[Tier, list[tuple[Entry, int, bool]]]]:
        """The sequence's blocks, and the loads that fill the fresh ones (entry, block, private)."""
        loads: dict[Tier, list[tuple[Entry, int, bool]]] = {Tier.HOST: [], Tier.DISK: []}
        blocks = []
        for entry in plan.reuse:
            if entry.device is None:
                blocks.append(fresh.pop())
                loads[Tier.HOST if entry.host is not None else Tier.DISK].append((entry, blocks[-1], False))
            else:
                blocks.append(entry.device)
        if plan.partial is not None:
            source, block = plan.partial[0], fresh.pop()
            blocks.append(block)
            if source.device is not None:
                self.cache.copy_block(source.device, block)
                self.pool.free([source.device])
                self.spill.settle(source)
            else:
                loads[Tier.HOST if source.host is not None else Tier.DISK].append((source, block, True))
        return blocks, loads

    def _close_admission(self, state: _SeqState) -> None:
        """Every load of the admission landed: cut the table before a failed block, then count
        what the sequence really reuses."""
        admission, state.admission = state.admission, None
        seq, stats = state.seq, self.stats
        if admission.failed:
            seq.recomputed_blocks += self._truncate(state, admission.failed)
        restored = sum(1 for block in seq.block_table.blocks if block in admission.loaded)
        seq.restored_blocks += restored
        stats.restored_blocks += restored
        if admission.restore:
            return
        reused = min(admission.tokens, seq.block_table.num_tokens)
        seq.prefix_tokens_reused += reused
        stats.lookups += 1
        stats.lookup_tokens += admission.lookup
        stats.hits += reused > 0
        stats.hit_tokens += reused

    def is_placed(self, seq: KVSequence) -> bool:
        state = self._seqs.get(seq.seq_id)
        return state is not None and state.placed

    def ready(self, seq: KVSequence) -> bool:
        self._settle_loads()
        state = self._seqs.get(seq.seq_id)
        return state is not None and state.placed and not state.moves

    def wait_ready(self, seq: KVSequence) -> None:
        """Block until the loads ``seq`` needs are done (the caller has nothing else to run)."""
        state = self._seqs.get(seq.seq_id)
        while state is not None and state.moves:
            self.spill.wait(state.moves[0])
            self._settle_loads()

    def _settle_loads(self) -> None:
        """Loads that landed: a sequence whose last load landed stops waiting (its table cut before
        a failed block only then, so no load in flight writes into a block given back)."""
        for move in self.spill.take_landed():
            state = self._seqs.get(move.seq_id)
            if state is None:
                continue
            state.moves.remove(move)
            state.admission.failed.update(move.dst_slots[i] for i in move.failed)
            if not state.moves:
                self._close_admission(state)

    def _truncate(self, state: _SeqState, bad_blocks: set[int]) -> int:
        """Cut the table before its first bad block: the sequence recomputes from there. Returns
        the blocks cut."""
        table = state.seq.block_table
        first = min(table.blocks.index(b) for b in bad_blocks)
        dropped = table.blocks[first:]
        table.blocks = table.blocks[:first]
        table.num_tokens = min(table.num_tokens, first * self.block_size)
        state.registered = min(state.registered, first)
        self.pool.free(dropped)
        for block in dropped:
            entry = self.index.on_device.get(block)
            if entry is not None:
                self.spill.settle(entry)
        return len(dropped)

    # --- running sequences -----------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        # Blank blocks answer the common case without counting what spills would free.
        return n <= self.pool.num_blank or n <= self.pool.num_blank + self.spill.reclaimable()

    def has_blank(self, n: int) -> bool:
        """``n`` blocks can be handed out without dropping or spilling anything."""
        return n <= self.pool.num_blank

    def allocate_for(self, seq: KVSequence, n: int) -> None:
        """``n`` more blocks at the end of ``seq``'s table; raises CapacityError when there is no room."""
        if n:
            self.spill.reclaim(n)
            seq.block_table.blocks += self.pool.allocate(n)

    def note_progress(self, seq: KVSequence) -> None:
        """Give keys to blocks that filled since the last call, so other requests can share them."""
        state = self._seqs.get(seq.seq_id)
        if state is not None and seq.block_table.num_tokens // self.block_size > state.registered:
            self._register_full(state)

    def _register_full(self, state: _SeqState) -> None:
        if not self.config.prefix_cache:
            return
        table, bs = state.seq.block_table, self.block_size
        full = table.num_tokens // bs
        keys = self._keys(state, full)
        for b in range(state.registered, full):
            block = table.blocks[b]
            if block in self.index.on_device:
                continue
            entry = self.index.full.get(keys[b])
            if entry is None:
                entry = Entry(keys[b], bs, self._aliases(state, b, bs))
                self.index.add(entry)
            elif entry.device is not None or entry.busy is not None:
                continue  # the same content already has a device copy: this block stays private
            self.spill.attach(entry, block)
        state.registered = max(state.registered, full)

    def _register_tail(self, state: _SeqState) -> None:
        """The last, unfilled block becomes a partial entry (a follow-up may copy it)."""
        table = state.seq.block_table
        b, valid = divmod(table.num_tokens, self.block_size)
        if not self.config.prefix_cache or not valid or b >= len(table.blocks) or table.blocks[b] in self.index.on_device:
            return
        key = self._partial_key(state, b, valid)
        if key not in self.index.partial:
            entry = Entry(key, valid, self._aliases(state, b, valid))
            self.index.add(entry)
            self.spill.attach(entry, table.blocks[b])

    def _entries_of(self, state: _SeqState) -> list[Entry]:
        out = []
        for b, block in enumerate(state.seq.block_table.blocks):
            entry = self.index.on_device.get(block)
            if entry is None and b < state.registered:
                entry = self.index.full.get(state.keys[b])  # a private duplicate of a cached block
            if entry is not None:
                out.append(entry)
        return out

    def _release_table(self, state: _SeqState) -> list[Entry]:
        """Register what the sequence computed, give its blocks back; returns its entries."""
        while state.moves:  # a load must not land in a block that was given away
            self.spill.wait(state.moves[0])
            self._settle_loads()
        self._register_full(state)
        self._register_tail(state)
        entries = self._entries_of(state)
        table = state.seq.block_table
        self.pool.free(table.blocks)
        for entry in entries:
            self.spill.settle(entry)
        table.blocks, table.num_tokens = [], 0
        state.registered, state.placed = 0, False
        return entries

    def preempt(self, seq: KVSequence) -> None:
        """Spill a running sequence whole: its blocks go to the host or disk tier and ``admit``
        brings them back; without a lower tier they stay idle on the device until reclaimed."""
        state = self._state(seq)
        entries = self._release_table(state)
        for entry in entries:
            entry.pins += 1
            self.spill.reprioritize(entry)
        state.pinned, state.preempted = entries, True
        self.stats.preemptions += 1
        dirty = [e for e in entries if e.device is not None and e.busy is None and self.pool.is_idle(e.device)
                 and e.host is None and e.disk is None]
        if dirty and self.spill.has_lower_tier:
            seq.spilled_blocks += self.spill.spill(dirty, urgent=True, lose_unplaced=False)

    def free(self, seq: KVSequence) -> None:
        """A finished or cancelled sequence: its blocks stay cached (idle) and go through to disk."""
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            self.pool.free(seq.block_table.blocks)
            seq.block_table.blocks, seq.block_table.num_tokens = [], 0
            return
        entries = self._release_table(state)
        self._unpin(state)
        mine = {id(e) for e in entries}
        seq.spilled_blocks += sum(id(e) in mine for e in self._relieve_device())  # above the watermark
        if self.config.write_through:
            self.spill.persist([e for e in entries if e.disk is None and e.busy is None])

    def _unpin(self, state: _SeqState) -> None:
        for entry in state.pinned:
            entry.pins -= 1
            self.spill.reprioritize(entry)
        state.pinned = []

    # --- once per step, and the rest -------------------------------------------------------------
    def poll(self) -> None:
        """Complete finished transfers; apply the watermarks and the available-memory floor."""
        self.spill.tick()
        if self.spill.has_lower_tier:
            self._watch_memory()
            self._relieve_device()
            self._relieve_host()
        self._settle_loads()

    def collect(self) -> bool:
        """Complete the transfers the worker finished, without a step (an idle engine calls this on its
        own thread, so blocks stop being reported as storing once their writes land). Returns whether
        transfers are still in flight."""
        self.spill.collect()
        self._settle_loads()
        return self.spill.in_flight

    def _watch_memory(self) -> None:
        """Read available memory when the floor wants a reading; warn once when it goes under."""
        if not self.floor.enabled:
            return
        now = self.clock()
        if self.floor.due(now) and self.floor.observe(self._available_memory(), now):
            self.stats.floor_events += 1
            log.warning("available memory is under the profile's floor of %d MiB: the host KV tier shrinks "
                        "and new spills go to disk", self.floor.floor_mb)

    def _relieve_device(self) -> list[Entry]:
        """Above the high watermark of device blocks holding content, spill idle ones down to the low
        one (without a lower tier, idle blocks wait to be reclaimed). Returns the entries moved."""
        spill, pool = self.spill, self.pool
        holding = pool.num_blocks - pool.num_blank
        # ``holding`` bounds the count from above without counting spills in flight (every step).
        if not spill.idle_candidates or not spill.has_lower_tier or not self.watermarks.over_high(
                holding, pool.num_blocks):
            return []
        excess = self.watermarks.device_excess(holding - spill.pinned_only(), pool.num_blocks)
        return spill.spill_coldest(excess) if excess > 0 else []

    def _relieve_host(self) -> None:
        host = self.spill.host
        if host is None:
            return
        excess = self.watermarks.host_excess(host.num_used, host.capacity, floor_breached=self.floor.breached,
                                             has_disk=self.spill.disk is not None)
        if excess > 0:
            self.spill.shrink_host(excess)

    def spill_idle(self, to: Tier | str | None = None) -> int:
        """Move idle blocks down now and wait for it; returns the blocks stored.

        ``None`` applies the watermarks; ``"host"`` moves every idle device block to the host
        tier; ``"disk"`` moves every idle block of the device and the host tier to disk.
        """
        self.spill.drain()  # blocks busy with a transfer are not candidates: let those finish first
        if to is None:
            before = self.stats.spilled_blocks
            self._relieve_device()
            self.spill.drain()
            moved = self.stats.spilled_blocks - before
        else:
            moved = self.spill.spill_all(Tier(to))
        self._settle_loads()
        return moved

    @property
    def disk(self):
        return self.spill.disk

    @property
    def host(self):
        return self.spill.host

    @property
    def worker(self):
        return self.spill.worker

    def counters(self) -> dict[str, int]:
        s = self.stats
        return {"prefix_hits": s.hits, "prefix_tokens_reused": s.hit_tokens, "spilled_blocks": s.spilled_blocks,
                "restored_blocks": s.restored_blocks, "persisted_blocks": s.persisted_blocks,
                "preemptions": s.preemptions, "recomputes": s.recomputes}

    def metrics(self) -> KVMetrics:
        """A snapshot; it reads but never changes the manager, so another thread may call it."""
        spill, s = self.spill, self.stats
        return KVMetrics(
            tiers=spill.tier_usage(), codec=self.codec.name, spilled_blocks=s.spilled_blocks,
            restored_blocks=s.restored_blocks, persisted_blocks=s.persisted_blocks, spill_bytes=s.spill_bytes, restore_bytes=s.restore_bytes,
            persist_bytes=s.persist_bytes, spill_latency=s.spill_latency.copy(),
            restore_latency=s.restore_latency.copy(), prefix_lookups=s.lookups, prefix_hits=s.hits,
            prefix_lookup_tokens=s.lookup_tokens, prefix_hit_tokens=s.hit_tokens, preemptions=s.preemptions,
            recomputes=s.recomputes, lost_blocks=s.lost_blocks, disk_errors=s.disk_errors,
            disk_repaired=spill.disk.repaired if spill.disk is not None else 0, floor_events=s.floor_events,
            transfer_s=s.transfer_s, wait_s=s.wait_s)

    def check(self) -> None:
        """Raise AssertionError where the bookkeeping disagrees with itself (for tests and debugging)."""
        problems = []
        for block, entry in self.index.on_device.items():
            if entry.device != block:
                problems.append(f"block {block} maps to an entry on block {entry.device}")
        for entry in self.index.entries():
            if entry.device is not None and self.index.on_device.get(entry.device) is not entry:
                problems.append(f"entry on block {entry.device} is not in the device map")
        problems += self.spill.problems()
        if problems:
            raise AssertionError("; ".join(problems))

    def flush(self) -> None:
        """Finish every transfer, and write through to disk what only memory holds."""
        self.spill.flush(self.config.write_through)
        self._settle_loads()

    def close(self) -> None:
        """Flush and release the tiers (the cache folder's lock too); the manager is done after this."""
        self._finalizer()
