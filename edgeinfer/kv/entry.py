"""Entries of the prefix cache, the index that finds them by key, and the moves between tiers.

An :class:`Entry` is one block's content, wherever it is: on the device (a pool block),
in a host slot, in a disk slot, or in several at once. Full blocks are found by their
chained key; the first ``j`` tokens of a block (an image that ends inside it, the last
unfilled block of a request) by a partial key.

A :class:`Move` is one prepared transfer of entries from one tier to another: the spill
manager prepares it, the mover executes it, the spill manager completes or rolls it back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from edgeinfer.kv.hashing import BlockKey
from edgeinfer.kv.policy import Priority
from edgeinfer.kv.worker import Job


class Tier(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class MoveKind(enum.Enum):
    SPILL = "spill"  # down a tier to make room: the source copy goes when the move completes
    PERSIST = "persist"  # a copy written through to disk: the source copy stays
    RESTORE = "restore"  # back onto the device for a sequence

    @property
    def is_store(self) -> bool:
        return self is not MoveKind.RESTORE

    @property
    def drops_source(self) -> bool:
        return self is MoveKind.SPILL


@dataclass(eq=False, slots=True)
class Entry:
    """A full block (``valid == block_size``) or the first ``valid`` tokens of one; compared by identity.

    ``busy`` is the one transfer using the entry (none may start another); ``pins`` counts
    preempted sequences waiting to get it back.
    """

    key: BlockKey
    valid: int
    aliases: tuple[tuple[BlockKey, int], ...] = ()
    device: int | None = None
    host: int | None = None
    disk: int | None = None
    busy: Move | None = None
    pins: int = 0

    @property
    def priority(self) -> Priority:
        return Priority.PREEMPTED if self.pins else Priority.IDLE

    def where(self, tier: Tier) -> int | None:
        """The entry's block (device) or slot (host, disk) in ``tier``; None when it has no copy there."""
        if tier is Tier.DEVICE:
            return self.device
        return self.host if tier is Tier.HOST else self.disk

    def place(self, tier: Tier, slot: int | None) -> None:
        """Record the entry's copy in ``tier`` (None: it has none there any more)."""
        if tier is Tier.DEVICE:
            self.device = slot
        elif tier is Tier.HOST:
            self.host = slot
        else:
            self.disk = slot

    @property
    def located(self) -> bool:
        return self.device is not None or self.host is not None or self.disk is not None

    @property
    def usable(self) -> bool:
        """On the device, or in a lower tier with no transfer in the way."""
        return self.device is not None or (self.busy is None and (self.host is not None or self.disk is not None))


@dataclass(eq=False)
class Move:
    """``entries`` from ``src`` (``src_slots``) to ``dst`` (``dst_slots``: host or disk slots, or device blocks)."""

    kind: MoveKind
    src: Tier
    dst: Tier
    entries: list[Entry]
    src_slots: list[int]
    dst_slots: list[int]
    private: list[bool] = field(default_factory=list)  # a restore into a sequence's own block (a partial copy)
    seq_id: int | None = None
    failed: list[int] = field(default_factory=list)  # indices of entries whose bytes did not arrive
    job: Job | None = None
    submitted: float = 0.0


class PrefixIndex:
    """Keys to entries, and device blocks to the entries they hold."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.full: dict[BlockKey, Entry] = {}
        self.partial: dict[BlockKey, tuple[Entry, int]] = {}
        self.on_device: dict[int, Entry] = {}

    def add(self, entry: Entry) -> None:
        if entry.valid == self.block_size:
            self.full[entry.key] = entry
        else:
            self.partial[entry.key] = (entry, entry.valid)
        for alias, j in entry.aliases:
            self.partial.setdefault(alias, (entry, j))

    def forget(self, entry: Entry) -> None:
        if self.full.get(entry.key) is entry:
            del self.full[entry.key]
        for key in (entry.key, *(a for a, _ in entry.aliases)):
            hit = self.partial.get(key)
            if hit is not None and hit[0] is entry:
                del self.partial[key]

    def knows(self, key: BlockKey) -> bool:
        return key in self.full or key in self.partial

    def prefix(self, key: BlockKey, j: int) -> Entry | None:
        """The entry whose first ``j`` tokens have partial key ``key``."""
        hit = self.partial.get(key)
        return hit[0] if hit is not None and hit[1] == j else None

    def entries(self) -> list[Entry]:
        """Every indexed entry once (a snapshot: safe to read from another thread)."""
        every = list(self.full.values()) + [e for e, _ in list(self.partial.values())]
        return list({id(e): e for e in every}.values())
