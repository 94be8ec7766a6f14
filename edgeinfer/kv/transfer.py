"""The code that moves a transfer's bytes between tiers.

The spill manager prepares a :class:`~edgeinfer.kv.entry.Move` (destination reserved,
sources pinned, entries busy) and completes or rolls it back; :class:`Mover` only
executes it, on the spill worker: it reads the source blocks, encodes or decodes them
with the tier codec, writes the destination, and records per-block failures (a checksum,
a read error) in ``move.failed`` instead of raising, so the rest of the move still lands.
"""

from __future__ import annotations

import logging

import torch

from edgeinfer.kv.codec import BlockCodec
from edgeinfer.kv.disk import ChecksumError, DiskStore
from edgeinfer.kv.entry import Move, Tier
from edgeinfer.kv.host import HostStore
from edgeinfer.kv.pool import KVCache
from edgeinfer.kv.worker import to_host

log = logging.getLogger(__name__)


class Mover:
    def __init__(self, cache: KVCache, codec: BlockCodec, host: HostStore | None, disk: DiskStore | None,
                 pin: bool) -> None:
        self.cache = cache
        self.codec = codec
        self.host = host
        self.disk = disk
        self.pin = pin

    def execute(self, move: Move) -> None:
        payload = self._read(move)
        if move.dst is Tier.DEVICE:
            ok = [i for i in range(len(move.entries)) if i not in move.failed]
            if ok:
                device = self.cache.device
                k, v = self.codec.decode(payload[ok].to(device, non_blocking=True))
                self.cache.write_blocks(torch.tensor([move.dst_slots[i] for i in ok], device=device), k, v)
        elif move.dst is Tier.HOST:
            for i, slot in enumerate(move.dst_slots):
                self.host.view(slot).copy_(payload[i], non_blocking=True)
        else:
            rows = to_host(payload).numpy()
            for i, slot in enumerate(move.dst_slots):
                entry = move.entries[i]
                self.disk.write(slot, entry.key, entry.valid, entry.aliases, rows[i])

    def _read(self, move: Move) -> torch.Tensor:
        """The source blocks encoded, ``[n, nbytes]``: on the device for loads from the (pinned) host."""
        if move.src is Tier.DEVICE:
            blocks = torch.tensor(move.src_slots, device=self.cache.device)
            return self.codec.encode(*self.cache.read_blocks(blocks))
        if move.src is Tier.HOST:
            device = self.cache.device if move.dst is Tier.DEVICE else "cpu"
            return torch.stack([self.host.view(s).to(device, non_blocking=True) for s in move.src_slots])
        rows = []
        for i, (entry, slot) in enumerate(zip(move.entries, move.src_slots)):
            try:
                rows.append(self.disk.read(slot, entry.key))
            except (ChecksumError, OSError) as error:
                log.warning("%s; the block is recomputed", error)
                move.failed.append(i)
                rows.append(bytearray(self.codec.nbytes))
        payload = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).view(len(rows), -1)
        return payload.pin_memory() if self.pin else payload
