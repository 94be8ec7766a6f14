"""The image-decode stage in front of the queue: bounded by bytes, counted against the floor.

Decoding is where a small file becomes a large buffer (a 121 KB PNG can hold 24 MP), so
decodes are not left to run as many at once as requests arrive. Each image's decode peak is
estimated from its header before any pixel is decoded (:func:`decode_peak_bytes`), and
reserved in a :class:`DecodeBudget` (a byte-weighted semaphore sized from the device
profile's memory) for the length of the decode:

- a decode that could never fit the budget is refused (422, the limit named);
- one that fits beside the decodes running now starts at once, so a small image never
  waits behind a large one; one that does not waits, first come first served among the
  waiting; when as many as the server's capacity are waiting already, it is refused with
  503 + Retry-After;
- one whose peak would push the memory available now (psutil) under the profile's floor is
  refused with 503 + Retry-After (``memory_pressure``): try later, not a bad request.

A request's images are decoded one after the other, so a request holds at most one
reservation at a time.

Decodes run on the stage's own threads at a lower CPU priority (nice +10) than the engine
thread: on a board with two cores, a burst of large pictures in front of the queue must not
slow the tokens of the requests already admitted.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import psutil
from PIL import Image

from edgeinfer.errors import MemoryPressureError, PreflightError, QueueFullError
from edgeinfer.preflight import (
    ImageRules, OnOversize, PreparedImage, pixels_to_decode, prepare_image, sniff_format, webp_canvas_size,
)
from edgeinfer.profiles import DeviceProfile
from edgeinfer.server.images import ImageRef, ImageSourcePolicy, read_ref

T = TypeVar("T")
log = logging.getLogger("edgeinfer.server")
_MIB = 2**20
# Bytes alive per decoded pixel at a decode's peak: the decoded source (up to 4 bytes a
# pixel, RGBA), its RGB conversion (3) and the resize's reduced intermediate (up to 4), with
# a byte of slack for the decoder's own buffers.
DECODE_BYTES_PER_PIXEL = 12
# The share of the memory left after the OS reserve and the KV budget that decodes may hold at once.
DECODE_SHARE = 8
# How much lower than the engine's the decode threads' CPU priority is (a nice increment).
DECODE_NICE = 10


def _lower_priority() -> None:
    """Thread initializer: this thread yields the CPU to the engine's (Linux nice values are per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + DECODE_NICE))
    except (AttributeError, OSError) as error:  # not Linux, or not permitted: decodes run at the usual priority
        log.debug("image decode threads keep the process priority: %s", error)


def decode_executor(threads: int | None = None) -> ThreadPoolExecutor:
    """The threads image decodes run on, at a lower CPU priority than the engine's."""
    return ThreadPoolExecutor(threads or os.cpu_count() or 1, thread_name_prefix="edgeinfer-decode",
                              initializer=_lower_priority)


def decode_peak_bytes(data: bytes, rules: ImageRules) -> int:
    """The bytes decoding ``data`` may hold at its peak, from its header alone; the decode cap's
    where the header cannot be read (preflight then refuses the image with the reason)."""
    return min(_header_pixels(data), rules.decode_cap) * DECODE_BYTES_PER_PIXEL if data else 0


def _header_pixels(data: bytes) -> int:
    try:
        fmt = sniff_format(data)
        if fmt == "WEBP":
            size = webp_canvas_size(data)
        else:
            with Image.open(io.BytesIO(data)) as lazy:  # reads the header only
                size = lazy.size
    except Exception:  # any unreadable header: preflight names it; count the worst case meanwhile
        return 2**62
    return 2**62 if size is None else pixels_to_decode(fmt, size)


def decode_budget_bytes(profile: DeviceProfile, rules: ImageRules) -> int:
    """A share of the memory the profile leaves after the OS reserve and the KV budget; never
    less than one largest decode (the decode cap) plus a full request's decoded images."""
    memory = profile.memory
    spare_mb = max(0, memory.total_mb - memory.os_reserve_mb - memory.kv_device_budget_mb)
    one_request = rules.decode_cap * DECODE_BYTES_PER_PIXEL + rules.max_images * rules.max_pixels * 3
    return max(spare_mb * _MIB // DECODE_SHARE, one_request)


@dataclass(frozen=True, slots=True)
class DecodeUsage:
    """What /metrics shows of the stage."""

    capacity_bytes: int
    reserved_bytes: int
    peak_bytes: int  # the most ever reserved at once since start
    running: int
    waiting: int


class DecodeBudget:
    """A byte-weighted semaphore for image decodes (event loop only): what fits now starts,
    the rest wait first come first served."""

    def __init__(self, capacity_bytes: int, floor_bytes: int, max_waiting: int,
                 available: Callable[[], int] = lambda: psutil.virtual_memory().available,
                 executor: ThreadPoolExecutor | None = None) -> None:
        if capacity_bytes < 1 or max_waiting < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 1 and max_waiting={max_waiting} >= 0")
        self.executor = executor  # where decodes run (None: asyncio's default threads)
        self.capacity_bytes = capacity_bytes
        self.floor_bytes = floor_bytes
        self.max_waiting = max_waiting
        self._available = available
        self._reserved = 0
        self._peak = 0
        self._running = 0
        self._queue: list[object] = []  # tickets of waiting reservations, oldest first
        self._changed = asyncio.Condition()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the stage's threads."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def usage(self) -> DecodeUsage:
        return DecodeUsage(self.capacity_bytes, self._reserved, self._peak, self._running, len(self._queue))

    @asynccontextmanager
    async def reserve(self, nbytes: int, source: str) -> AsyncIterator[None]:
        """Hold ``nbytes`` of the budget while the body runs; see the module docstring for refusals."""
        if nbytes > self.capacity_bytes:
            raise PreflightError("decode_memory", nbytes, self.capacity_bytes,
                                 "a smaller image, or more memory.total_mb in the profile",
                                 what="bytes to decode the image (image decode budget)", source=source)
        if not self._fits_now(nbytes):
            await self._wait_for_room(nbytes)
        self._check_floor(nbytes, source)
        self._reserved += nbytes
        self._running += 1
        self._peak = max(self._peak, self._reserved)
        try:
            yield
        finally:
            self._reserved -= nbytes
            self._running -= 1
            await self._notify()

    async def _wait_for_room(self, nbytes: int) -> None:
        if len(self._queue) >= self.max_waiting:
            raise QueueFullError(f"server busy: {len(self._queue)} image decodes are waiting for memory, the "
                                 f"limit is {self.max_waiting}; retry after 1 s", 1)
        ticket = object()
        self._queue.append(ticket)
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._queue[0] is ticket and self._fits_now(nbytes))
                self._queue.pop(0)
                self._changed.notify_all()  # the next in line may fit too
        except BaseException:
            if ticket in self._queue:
                self._queue.remove(ticket)
                await self._notify()
            raise

    def _fits_now(self, nbytes: int) -> bool:
        return self._reserved + nbytes <= self.capacity_bytes

    def _check_floor(self, nbytes: int, source: str) -> None:
        left = self._available() - nbytes
        if left < self.floor_bytes:
            floor_mb = max(0, left // _MIB)
            raise MemoryPressureError("memory_pressure", left, self.floor_bytes,
                                      f"retry when memory is free, or --set memory.available_floor_mb={floor_mb}",
                                      what="bytes available after decoding the image (floor)", source=source)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


async def prepare_refs(refs: Sequence[ImageRef], rules: ImageRules, on_oversize: OnOversize | str,
                       policy: ImageSourcePolicy, budget: DecodeBudget) -> list[PreparedImage]:
    """Count the images, then read, reserve and decode each in order."""
    check_image_count(len(refs), rules)
    prepared = []
    for ref in refs:
        data = await read_ref(ref, rules.max_file_bytes, policy)
        prepared.append(await decode_one(data, rules, on_oversize, ref.where, budget))
    return prepared


def check_image_count(count: int, rules: ImageRules, source: str = "messages") -> None:
    if count > rules.max_images:
        override = None if "max_images" in rules.model_limited else f"--set images.max_images={count}"
        raise PreflightError("too_many_images", count, rules.max_images, override,
                             what="images in the request (max_images)", source=source)


async def decode_one(data: bytes, rules: ImageRules, on_oversize: OnOversize | str, where: str,
                     budget: DecodeBudget) -> PreparedImage:
    """Preflight one image's bytes on a worker thread, holding its decode peak in ``budget``."""
    peak = await budget.run(decode_peak_bytes, data, rules)
    async with budget.reserve(peak, where):
        return await _even_if_cancelled(budget.run(prepare_image, data, rules, on_oversize, where))


async def _even_if_cancelled(work: Awaitable[T]) -> T:
    """Await ``work``; if cancelled, still wait for it (a thread cannot be stopped), so its memory
    is counted until it is really free."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait({future})
        raise
