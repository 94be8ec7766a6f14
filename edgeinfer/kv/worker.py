"""The spill worker: one thread that moves bytes between tiers, off the decode path.

It runs jobs (plain callables prepared by the KV manager) and never touches the
manager's bookkeeping: the manager prepares a transfer (reserves its destination, pins
its source), the worker executes it, and the manager completes or rolls it back on its
own thread when it sees the job finished. Urgent jobs (a load a sequence waits for, a
store whose room is needed now) go before background ones (watermark spills, writes
through to disk). A job the manager must wait for that has not started yet runs on the
waiting thread instead, which saves a hand-off.

On a GPU every job runs on a side CUDA stream: it first waits for an event recorded on
the compute stream when the job was prepared (so it reads what the last step wrote),
then the worker waits for the job's own event before reporting it done (so the pinned
buffers it used are free again). The compute stream itself never waits.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable

import torch


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory. From a GPU it is copied into page-locked memory and waited for on an
    event: a copy into pageable memory waits for the stream's queued work inside the copy call, and
    the engine thread's CUDA calls wait behind it (a stalled decode step for every picture stored)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host


class Job:
    __slots__ = ("after", "done", "error", "fn", "seconds", "state", "urgent")

    def __init__(self, fn: Callable[[], None], urgent: bool, after=None) -> None:
        self.fn = fn
        self.urgent = urgent
        self.after = after  # a torch.cuda.Event recorded on the compute stream, or None
        self.state = JobState.QUEUED  # -> RUNNING -> DONE
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.done = threading.Event()


class SpillWorker:
    IDLE_EXIT_S = 5.0

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queues: dict[bool, deque[Job]] = {True: deque(), False: deque()}
        self._cond = threading.Condition()
        self._finished: deque[Job] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._current: Job | None = None  # the job the thread is running

    def compute_event(self):
        """An event on the current (compute) stream for a job to wait on; None on CPU."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the spill worker is closed")
            self._queues[job.urgent].append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="edgeinfer-kv-spill", daemon=True)
                self._thread.start()
            self._cond.notify()
        return job

    def finished(self) -> list[Job]:
        """Jobs done since the last call, in the order they finished."""
        with self._cond:
            out = list(self._finished)
            self._finished.clear()
        return out

    def wait(self, job: Job) -> None:
        """Return when ``job`` is done; a job still queued runs here and now."""
        with self._cond:
            claimed = job.state is JobState.QUEUED
            if claimed:
                self._queues[job.urgent].remove(job)
                job.state = JobState.RUNNING
        if claimed:
            self._run(job)
        else:
            job.done.wait()

    def drain(self) -> None:
        """Run every queued job and wait for all of them."""
        while True:
            with self._cond:
                queued = list(self._queues[True]) + list(self._queues[False])
                current = self._current
            if not queued and current is None:
                return
            for job in queued:
                self.wait(job)
            if current is not None:
                current.done.wait()

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def _next(self) -> Job | None:
        """The next job, or None when stopping or idle for ``IDLE_EXIT_S`` (the thread then ends;
        ``submit`` starts a new one)."""
        with self._cond:
            if not (self._queues[True] or self._queues[False] or self._stopping):
                self._cond.wait(self.IDLE_EXIT_S)
            queue = self._queues[True] or self._queues[False]
            if not queue:
                self._thread = None
                return None
            job = queue.popleft()
            job.state = JobState.RUNNING
            self._current = job
            return job

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            self._run(job)
            with self._cond:
                self._current = None

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            with torch.inference_mode():  # the engine's tensors may be inference tensors
                if self._stream is None:
                    job.fn()
                else:
                    with torch.cuda.stream(self._stream):
                        if job.after is not None:
                            self._stream.wait_event(job.after)
                        job.fn()
                        done = torch.cuda.Event()
                        done.record(self._stream)
                    done.synchronize()
        except BaseException as error:  # noqa: BLE001 - handed to the manager's rollback
            job.error = error
        job.seconds = time.perf_counter() - started
        with self._cond:
            job.state = JobState.DONE
            self._finished.append(job)
        job.done.set()
