"""The engine on its own thread, for asyncio callers such as the HTTP daemon.

The :class:`~edgeinfer.engine.engine.Engine` is synchronous and single-threaded.
``AsyncEngine`` gives it exactly one thread, which loops ``engine.step()`` while there
is work. Every engine call (``submit``, ``step``, ``cancel``, ``text_delta``,
``result``) happens on that thread; the event loop only talks to it through an inbox
that the thread empties between two steps. So a request that arrives while others
decode joins their batch at the next step (continuous batching).

Tokens travel back through one ``asyncio.Queue`` per request, fed from the engine
thread with ``loop.call_soon_threadsafe``. Cancelling (a client that went away, a
deadline) is a message to the engine thread too: it cancels the sequence there, which
frees its KV blocks at once.

Every check comes before admission and off the engine thread: :meth:`AsyncEngine.prepare`
counts the characters of the prompt against the context (a lower bound on its tokens, so an
over-long prompt is refused before it is tokenized), then renders, tokenizes and checks it
on a thread of its own. A request that can never fit is refused there however busy the
engine is; the engine thread only encodes images and steps.

Admission is bounded: ``max_concurrent`` requests are in the engine, ``max_queue`` more
wait for a slot, and past that :meth:`AsyncEngine.submit` raises
:class:`QueueFullError` at once (a :class:`CapacityError`, with a retry hint). :meth:`AsyncEngine.drain`
stops admitting and waits for the requests in flight, for a shutdown; what is left then
fails with :class:`ServerShuttingDown` (HTTP 503).

Sleep (:meth:`AsyncEngine.control`, and idle release after ``idle_sleep_s``) runs on the
engine thread too, once no request is inside the engine; requests that arrive meanwhile
wait, and the first of them wakes the engine (each one's ``timings`` say how long the wake
took). :meth:`AsyncEngine.set_limits` lowers or restores admission while it runs (a board
at its power or heat limit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Callable, Iterable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, TypeVar

from edgeinfer.engine.engine import Engine
from edgeinfer.engine.inputs import Message, PreparedPrompt
from edgeinfer.engine.output import GenerationResult
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.engine.sequence import Sequence, Status
from edgeinfer.errors import (
    EdgeInferError, EngineFailure, LimitExceeded, QueueFullError, RequestCancelled, RequestError, RequestTimedOut,
    ServerShuttingDown,
)

log = logging.getLogger(__name__)

MetricTriple = tuple[str, dict[str, str], float]
T = TypeVar("T")


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One chat (or plain prompt) with its images, as the engine's ``submit`` takes it.

    ``prepared`` is set by :meth:`AsyncEngine.prepare`: the prompt rendered, tokenized and
    checked, so the engine thread does not do it again."""

    prompt: str | list[Message]
    images: tuple[Any, ...] = ()
    sampling: SamplingParams = SamplingParams()
    timeout_s: float | None = None
    prepared: PreparedPrompt | None = None


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Server-side times of one request, from its arrival at :meth:`AsyncEngine.submit`."""

    queued_s: float  # waiting for an engine slot
    ttft_s: float | None  # to the first token
    tpot_s: float | None  # mean time per output token after the first
    total_s: float


@dataclass(frozen=True, slots=True)
class Completion:
    result: GenerationResult
    stats: RequestStats


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the metrics see, published by the engine thread (never read from the engine live)."""

    kv_free: int = 0  # blocks no sequence owns (blank, or idle in the prefix cache)
    kv_total: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    kv: Any = None  # the engine's ``kv_metrics()`` snapshot, where it has one


@dataclass(frozen=True, slots=True)
class _Admitted:
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class _Delta:
    text: str


@dataclass(frozen=True, slots=True)
class _Finished:
    completion: Completion


@dataclass(frozen=True, slots=True)
class _Failed:
    error: EdgeInferError


_Event = _Admitted | _Delta | _Finished | _Failed


class _Trimmer:
    """Makes the streamed text add up to ``GenerationResult.text`` (which is stripped):
    leading whitespace is dropped, trailing whitespace is held until more text follows."""

    __slots__ = ("started", "held")

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def feed(self, delta: str) -> str:
        if not self.started:
            delta = delta.lstrip()
            self.started = bool(delta)
        body = delta.rstrip()
        if not body:
            self.held += delta
            return ""
        out, self.held = self.held + body, delta[len(body):]
        return out


class RequestHandle:
    """One request in flight, seen from the event loop.

    ``admitted()`` returns once the engine took the request (or raises its error);
    ``deltas()`` yields the answer's text as it grows; ``completion`` is set when it ends.
    Leaving ``deltas()`` early, or ``cancel()``, cancels the request in the engine.
    """

    def __init__(self, owner: AsyncEngine, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.arrived = time.perf_counter()
        self.deadline = None if request.timeout_s is None else self.arrived + request.timeout_s
        self.completion: Completion | None = None
        self.prompt_tokens: int | None = None
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._ended = False  # event-loop side: a final event was read
        # Engine thread only:
        self.seq: Sequence | None = None
        self.submitted_at: float | None = None
        self.finished = False
        self.trimmer = _Trimmer()
        self.wake_s = 0.0  # the engine's wake this request waited for

    # --- event loop side ------------------------------------------------------------
    async def admitted(self) -> None:
        """Wait until the engine has the request; raises what the engine refused it with."""
        try:
            event = await self._queue.get()
        except BaseException:
            self.cancel()
            raise
        if isinstance(event, _Failed):
            self._ended = True
            raise event.error
        if not isinstance(event, _Admitted):  # a final event cannot come before admission
            raise EngineFailure(f"request got {type(event).__name__} before it was admitted")
        self.prompt_tokens = event.prompt_tokens

    async def deltas(self) -> AsyncIterator[str]:
        """The answer's text in pieces; sets ``completion`` at the end; raises the request's error."""
        try:
            while not self._ended:
                event = await self._queue.get()
                if isinstance(event, _Admitted):
                    self.prompt_tokens = event.prompt_tokens
                elif isinstance(event, _Delta):
                    yield event.text
                elif isinstance(event, _Finished):
                    self._ended = True
                    self.completion = event.completion
                elif isinstance(event, _Failed):
                    self._ended = True
                    raise event.error
        finally:
            if not self._ended:
                self.cancel()

    async def result(self) -> Completion:
        async for _ in self.deltas():
            pass
        assert self.completion is not None
        return self.completion

    def cancel(self) -> None:
        """Cancel in the engine (idempotent; a finished request is left alone)."""
        if not self._ended:
            self._owner._request_cancel(self)

    # --- engine thread side -----------------------------------------------------------
    def emit(self, event: _Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


# --------------------------------------------------------------------------- the engine


def freeze_start_up_objects() -> None:
    """Move every object alive now out of the garbage collector's sight, once a serving process
    is ready. The model, its compiled graphs and the compiler's caches are Python objects that
    live as long as the process (one compiled layer leaves about half a million); left in view,
    each full collection walks all of them while every thread (the engine's and the event loop's)
    waits, and a burst of requests or large bodies triggers one."""
    gc.collect()
    gc.freeze()


class AsyncEngine:
    """An Engine driven by one background thread; see the module docstring."""

    SNAPSHOT_EVERY_S = 0.2
    TRANSFER_POLL_S = 0.05  # while idle with KV transfers in flight: how often to complete them

    def __init__(self, engine: Engine, *, max_concurrent: int, max_queue: int,
                 idle_sleep_s: float | None = None, idle_sleep_level: int = 1) -> None:
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError(f"max_concurrent={max_concurrent} must be >= 1 and max_queue={max_queue} >= 0")
        self.engine = engine
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.retry_factor = 1.0  # Retry-After is stretched by this while admission is lowered
        self.idle_sleep_s = idle_sleep_s
        self.idle_sleep_level = idle_sleep_level
        self._controls: list[tuple[Callable[[Engine], Any], concurrent.futures.Future]] = []
        self._idle_since = time.monotonic()  # engine thread: when the last request left
        self._cond = threading.Condition()
        # Shared, under _cond:
        self._inbox: list[RequestHandle] = []
        self._cancels: list[tuple[RequestHandle | None, EdgeInferError]] = []
        self._outstanding = 0  # submitted and not finished
        self._running = 0  # of those, inside the engine
        self._accepting = True
        self._stopping = False
        self._mean_latency_s = 1.0
        # Engine thread only:
        self._pending: deque[RequestHandle] = deque()
        self._active: dict[int, RequestHandle] = {}
        self._last_snapshot = 0.0
        self.snapshot = EngineSnapshot()
        self._thread = threading.Thread(target=self._run, name="edgeinfer-engine", daemon=True)
        # One thread renders and tokenizes ahead of admission: bounded work, never on the engine thread.
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="edgeinfer-prepare")
        self.max_token_chars = longest_token_chars(engine.adapter.tokenizer)

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._publish_snapshot()
        self._thread.start()
        return self

    async def drain(self, grace_s: float) -> int:
        """Stop admitting; wait up to ``grace_s`` for the requests in flight; end the rest with
        :class:`ServerShuttingDown` (queued ones are never started, running ones are cut).

        Returns how many were ended that way.
        """
        with self._cond:
            self._accepting = False
        deadline = time.monotonic() + max(0.0, grace_s)
        while self.outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.outstanding
        if left:
            self._cancel_everything(ServerShuttingDown(
                f"the server shut down before the answer was done (grace period {grace_s:g} s); retry "
                f"against the restarted server", self.retry_after_s()))
        return left

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread; requests still in flight fail as cancelled."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self._preparer.shutdown(wait=False, cancel_futures=True)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def running(self) -> int:
        return self._running

    @property
    def queue_depth(self) -> int:
        """Requests waiting for an engine slot."""
        return self._outstanding - self._running

    @property
    def capacity(self) -> int:
        return self.max_concurrent + self.max_queue

    # --- checking (event loop side, work on the prepare thread) --------------------------
    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` checked against every limit of the engine and tokenized, off the engine
        thread; raises the request's typed error (a 4xx) whatever the queue holds."""
        self.check_text_bounds(request)
        if not self._accepting:
            raise ServerShuttingDown("the server is shutting down and takes no new requests", self.retry_after_s())
        loop = asyncio.get_running_loop()
        engine, prompt, images, sampling = self.engine, request.prompt, request.images, request.sampling
        try:
            prepared = await loop.run_in_executor(self._preparer, engine.prepare, prompt, images, sampling)
        except EdgeInferError:
            raise
        except Exception as exc:
            raise _typed(exc) from exc
        return dataclasses.replace(request, prepared=prepared)

    def check_text_bounds(self, request: GenerationRequest) -> None:
        """Refuse text that cannot be tokenized or cannot fit, by counting characters only.

        No token spans more than ``max_token_chars`` characters, so a prompt of N characters
        has at least N / max_token_chars tokens: past the context by that count alone, it is
        refused before the tokenizer (whose time grows with the text) ever sees it."""
        texts = list(prompt_texts(request.prompt))
        for text in texts:
            if not is_utf8(text):
                raise RequestError("the prompt holds text that is not valid Unicode (a lone surrogate "
                                   "such as \\ud800); send UTF-8 text")
        chars = sum(len(text) for text in texts)
        least = -(-chars // self.max_token_chars) + request.sampling.max_new_tokens
        limit = self.engine.config.max_context
        if least > limit:
            raise LimitExceeded(f"prompt + max_new_tokens (at least, counting {chars} characters of prompt)",
                                least, limit, "--set runtime.max_context_tokens=N", "context_length")

    # --- submitting (event loop side) ----------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Seq[GenerationRequest]) -> list[RequestHandle]:
        """Take all of ``requests`` or none (QueueFullError). Call from the event loop."""
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(self, request, loop) for request in requests]
        with self._cond:
            self._refuse_unless_room(len(handles))
            self._outstanding += len(handles)
            self._inbox.extend(handles)
            self._cond.notify_all()
        return handles

    async def generate(self, request: GenerationRequest) -> Completion:
        handle = self.submit(request)
        await handle.admitted()
        return await handle.result()

    async def stream(self, request: GenerationRequest) -> AsyncIterator[str]:
        handle = self.submit(request)
        await handle.admitted()
        async for delta in handle.deltas():
            yield delta

    def _refuse_unless_room(self, n: int) -> None:
        retry = self.retry_after_s()
        if not self._accepting:
            raise ServerShuttingDown("the server is shutting down and takes no new requests", retry)
        if n > self.capacity:
            raise RequestError(f"{n} requests at once is over the server's capacity of {self.capacity} "
                               f"(max_concurrent {self.max_concurrent} + max_queue {self.max_queue})")
        if self._outstanding + n > self.capacity:
            raise QueueFullError(
                f"server busy: {self._outstanding} requests in flight or queued, the limit is {self.capacity} "
                f"(max_concurrent {self.max_concurrent} + max_queue {self.max_queue}); "
                f"retry after {retry} s", retry)

    def retry_after_s(self) -> int:
        """A hint for Retry-After: the mean request time times the queue ahead, per slot, stretched
        by ``retry_factor`` while admission is lowered."""
        waves = 1 + self.queue_depth / self.max_concurrent
        factor = self.retry_factor
        return int(min(60 * factor, max(factor, math.ceil(self._mean_latency_s * waves * factor))))

    # --- control (any thread, run on the engine thread) -------------------------------------
    def set_limits(self, max_concurrent: int, max_queue: int, retry_factor: float = 1.0) -> None:
        """Change admission while running; requests already admitted finish as they are."""
        if max_concurrent < 1 or max_queue < 0 or retry_factor < 1:
            raise ValueError(f"max_concurrent={max_concurrent} must be >= 1, max_queue={max_queue} >= 0 and "
                             f"retry_factor={retry_factor} >= 1")
        with self._cond:
            self.max_concurrent, self.max_queue, self.retry_factor = max_concurrent, max_queue, retry_factor
            self._cond.notify_all()

    async def control(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread once no request is inside the engine (sleep,
        wake, cache maintenance); requests arriving meanwhile wait for it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise RequestCancelled("the engine has stopped")
            self._controls.append((fn, future))
            self._cond.notify_all()
        return await asyncio.wrap_future(future)

    @property
    def is_sleeping(self) -> bool:
        return bool(getattr(self.engine, "is_sleeping", False))

    # --- cancelling (any thread) ------------------------------------------------------------
    def _request_cancel(self, handle: RequestHandle,
                        error: EdgeInferError | None = None) -> None:
        with self._cond:
            self._cancels.append((handle, error or RequestCancelled("the request was cancelled")))
            self._cond.notify_all()

    def _cancel_everything(self, error: EdgeInferError) -> None:
        """Ask the engine thread to cancel every request it holds (``None`` stands for all)."""
        with self._cond:
            self._cancels.append((None, error))
            self._cond.notify_all()

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._next_round():
                self._step()
                self._publish_snapshot()
        finally:
            self._fail_all(RequestCancelled("the engine stopped before the answer was done"))
            self._close_engine()
            self._publish_snapshot(force=True)

    def _close_engine(self) -> None:
        """Let the engine finish its own work (KV transfers, write-through), on this thread."""
        close = getattr(self.engine, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:
            log.exception("closing the engine failed")

    def _next_round(self) -> bool:
        """Take new requests and cancellations, waiting while there is nothing to do."""
        with self._cond:
            while not (self._inbox or self._cancels or self._pending or self._active or self._stopping
                       or self._controls):
                in_flight = self._collect_transfers()
                self._publish_snapshot(force=True)
                wait_s = self._idle_wait_s()
                if wait_s == 0.0:
                    break  # idle release is due: done below, without holding the lock
                if in_flight:
                    wait_s = self.TRANSFER_POLL_S if wait_s is None else min(wait_s, self.TRANSFER_POLL_S)
                self._cond.wait(wait_s)
            if self._stopping:
                return False
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        self._pending.extend(inbox)
        for handle, error in cancels:
            for target in ([*self._pending, *self._active.values()] if handle is None else [handle]):
                self._cancel_now(target, error)
        self._expire(time.perf_counter())
        self._run_controls()
        self._admit()
        if self._active or self._pending:
            self._idle_since = time.monotonic()
        elif self._idle_wait_s() == 0.0:
            self._sleep_when_idle()
        return True

    def _idle_wait_s(self) -> float | None:
        """Seconds until idle release is due; None when there is none to do."""
        if self.idle_sleep_s is None or self.is_sleeping:
            return None
        return max(0.0, self._idle_since + self.idle_sleep_s - time.monotonic())

    def _sleep_when_idle(self) -> None:
        """Idle release: nothing has run for ``idle_sleep_s``."""
        try:
            self.engine.sleep(self.idle_sleep_level)
        except Exception:
            log.exception("idle release failed; the engine stays awake")
            self._idle_since = time.monotonic()
        self._publish_snapshot(force=True)

    def _run_controls(self) -> None:
        """Controls run when no request is inside the engine; until then admission waits for them."""
        if self._active:
            return
        with self._cond:
            controls, self._controls = self._controls, []
        for fn, future in controls:
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # the caller gets the error; the engine thread goes on
                future.set_exception(exc)
        if controls:
            self._idle_since = time.monotonic()
            self._publish_snapshot(force=True)

    def _wake_for(self, waiting: list[RequestHandle]) -> bool:
        """Wake the engine for the requests ``waiting``; False (each failed) when it cannot."""
        if not self.is_sleeping:
            return True
        try:
            seconds = self.engine.wake_up()
        except Exception as exc:
            log.exception("waking the engine failed")
            for handle in waiting:
                self._pending.remove(handle)
                self._finish(handle, _Failed(_typed(exc)))
            return False
        for handle in waiting:
            handle.wake_s = seconds
        return True

    def _collect_transfers(self) -> bool:
        """Complete KV transfers that landed while no step runs (an idle engine's metrics must not stay
        at "storing"); whether some are still in flight."""
        kv = getattr(self.engine, "kv_manager", None)
        if kv is None:
            return False
        try:
            return kv.collect()
        except Exception:  # completing a transfer must never take the engine thread down
            log.exception("completing KV transfers failed")
            return False

    def _admit(self) -> None:
        """Submit the next waiting request to the engine once it is ready for one
        (:attr:`Engine.ready_for_request`: when the prompts inside are prefilled, or on a GPU while
        one is): its pictures are encoded, and its prompt is prefilled in the steps that follow.
        A burst of requests so gets its first tokens one after another, not all of them after every
        picture of the burst is encoded."""
        if self._controls or not self._pending or not self.engine.ready_for_request or \
                not self._wake_for(list(self._pending)):
            return
        while self._pending and len(self._active) < self.max_concurrent:
            handle = self._pending.popleft()
            request = handle.request
            try:
                seq = (self.engine.submit(request.prompt, request.images, request.sampling)
                       if request.prepared is None else self.engine.submit_prepared(request.prepared,
                                                                                    request.sampling))
            except Exception as exc:  # the request's fault (typed) or a bug (EngineFailure)
                self._finish(handle, _Failed(_typed(exc)))
                continue  # a refused request takes no turn: the next one may enter
            handle.seq, handle.submitted_at = seq, time.perf_counter()
            seq.timings.wake_s = handle.wake_s
            self._active[seq.seq_id] = handle
            with self._cond:
                self._running += 1
            handle.emit(_Admitted(seq.prompt_len))
            return  # one request a round

    def _step(self) -> None:
        if not self._active or not self.engine.has_work():
            return
        try:
            stepped = self.engine.step(joining=len(self._pending))
        except Exception as exc:
            log.exception("engine step failed; failing the %d requests in it", len(self._active))
            self._fail_all(_typed(exc))
            return
        now = time.perf_counter()
        for seq in stepped:
            handle = self._active.get(seq.seq_id)
            if handle is None:
                continue
            delta = handle.trimmer.feed(self.engine.text_delta(seq))
            if delta:
                handle.emit(_Delta(delta))
            if seq.status is Status.FINISHED:
                self._complete(handle, now)
        # A sequence the engine ended without a token this step (none should): still answer it.
        for handle in [h for h in self._active.values() if h.seq is not None and h.seq.status is Status.FINISHED]:
            self._complete(handle, now)
        if not stepped:
            time.sleep(0.001)  # the engine waits on something (a KV transfer): do not spin hot

    def _complete(self, handle: RequestHandle, now: float) -> None:
        seq = handle.seq
        assert seq is not None
        result = self.engine.result(seq)
        del self._active[seq.seq_id]
        first = seq.timings.first_token  # perf_counter, as ``arrived``
        n = len(result.token_ids)
        stats = RequestStats(
            queued_s=(handle.submitted_at or now) - handle.arrived,
            ttft_s=None if first is None else first - handle.arrived,
            tpot_s=(now - first) / (n - 1) if first is not None and n > 1 else None,
            total_s=now - handle.arrived,
        )
        self._mean_latency_s = 0.8 * self._mean_latency_s + 0.2 * stats.total_s
        self._finish(handle, _Finished(Completion(result, stats)))

    def _cancel_now(self, handle: RequestHandle, error: EdgeInferError) -> None:
        if handle.finished:
            return
        if handle in self._pending:
            self._pending.remove(handle)
        elif handle.seq is not None and handle.seq.seq_id in self._active:
            self._release(handle.seq)
        self._finish(handle, _Failed(error))

    def _release(self, seq: Sequence) -> None:
        """Cancel ``seq`` in the engine: frees its KV blocks; ``result`` drops its text state."""
        del self._active[seq.seq_id]
        try:
            if seq.status is not Status.FINISHED:
                self.engine.cancel(seq)
            self.engine.result(seq)
        except Exception:  # cancelling must never take the engine thread down
            log.exception("cancelling sequence %d failed", seq.seq_id)

    def _expire(self, now: float) -> None:
        for handle in [*self._pending, *self._active.values()]:
            if handle.deadline is not None and now > handle.deadline:
                generated = len(handle.seq.generated) if handle.seq is not None else 0
                self._cancel_now(handle, RequestTimedOut(handle.request.timeout_s or 0.0, generated))

    def _fail_all(self, error: EdgeInferError) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            controls, self._controls = self._controls, []
        for _, future in controls:
            future.set_exception(error)
        self._pending.extend(inbox)
        for handle in [*self._pending, *self._active.values(), *(h for h, _ in cancels if h is not None)]:
            self._cancel_now(handle, error)

    def _finish(self, handle: RequestHandle, event: _Finished | _Failed) -> None:
        handle.finished = True
        with self._cond:
            self._outstanding -= 1
            if handle.submitted_at is not None:
                self._running -= 1
        handle.emit(event)

    def _publish_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_snapshot < self.SNAPSHOT_EVERY_S:
            return
        self._last_snapshot = now
        pool = self.engine.pool  # None while the engine sleeps
        self.snapshot = EngineSnapshot(
            kv_free=pool.num_free if pool is not None else 0, kv_total=pool.num_blocks if pool is not None else 0,
            counters=dict(getattr(self.engine, "counters", {})),
            kv=_kv_metrics(self.engine),
        )


def prompt_texts(prompt: str | list[Message]) -> Iterable[str]:
    """Every piece of text in a prompt: the string itself, or each message's text parts."""
    if isinstance(prompt, str):
        yield prompt
        return
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    yield text


def is_utf8(text: str) -> bool:
    """False for text UTF-8 cannot carry (lone surrogates, which JSON's \\uXXXX escapes can make)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary entry)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1


def _typed(exc: BaseException) -> EdgeInferError:
    if isinstance(exc, EdgeInferError):
        return exc
    template_error = _template_error_type()
    if template_error is not None and isinstance(exc, template_error):
        return RequestError(f"the model's chat template cannot render these messages: {exc}")
    log.error("engine raised %s", type(exc).__name__, exc_info=exc)
    return EngineFailure(f"internal error in the engine ({type(exc).__name__}); see the server log")


def _template_error_type() -> type[BaseException] | None:
    try:
        from jinja2 import TemplateError
    except ImportError:
        return None
    return TemplateError


def _kv_metrics(engine: Engine) -> Any:
    """The engine's own KV metrics snapshot where it has ``kv_metrics()``, else None."""
    method: Callable[[], Any] | None = getattr(engine, "kv_metrics", None)
    if method is None:
        return None
    try:
        return method()
    except Exception:
        log.exception("kv_metrics() failed")
        return None


def metric_triples(raw: Any) -> Iterable[MetricTriple]:
    """A KV snapshot as (name, labels, value): it may iterate as triples, or be a name -> number map."""
    if isinstance(raw, dict):
        for name, value in raw.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                full = name if str(name).startswith("edgeinfer_") else f"edgeinfer_kv_{name}"
                yield full, {}, float(value)
        return
    for item in raw or ():
        if isinstance(item, tuple) and len(item) == 3 and isinstance(item[1], dict):
            yield str(item[0]), {str(k): str(v) for k, v in item[1].items()}, float(item[2])
