"""torch.compile's compile workers: started as a load begins, let go once it ends.

Inductor compiles its Triton kernels in a pool of worker processes (one a core, up to 32),
which it starts at the first compile, late in an engine's load. The pool's first process then
imports torch at a full core for a few seconds. After a short load those seconds fell on the
first requests: torch's host threads, one a core, waited for a CPU, and a picture's
preprocessing took 5x as long (docs/results/probes/h100-compile-workers). Started as the load
begins, that start overlaps reading the checkpoint and slows it instead: on an H100 machine a
warm load (the bench's, which captures nothing at start-up) took 4 s longer, and torch's threads
then waited for a CPU 33-65 ms in the 6 s after it, not 1.7-2.0 s
(docs/results/probes/h100-compile-workers-check).

Once the load has compiled and captured what its budget allows, requests compile only what
that budget left out, while the pool keeps its processes: 556-557 MiB of PSS with 16 workers on
that machine, memory that a board's KV pool needs. So the load lets the pool go once it is up
(a short load leaves it to finish its start, since stopping it would wait for that); inductor
starts it again at its next compile, and until it is up compiles in the process itself. A wake
from sleep starts none, and lets go of one that its compiles started.

Only a load that captures at start-up does this (CUDA graphs with ``runtime.capture_budget_s``
over 0: the daemon's profiles), since after it live traffic compiles nothing. A load that leaves its graphs to first use
(``edgeinfer run``, the benchmarks) leaves the workers to torch: its first requests compile, and
would start the workers again right after the load had stopped them, and the early start costs
its load the seconds above.

Torch's own switches still rule: ``TORCHINDUCTOR_COMPILE_THREADS=1`` (no pool) and
``TORCH_WARM_POOL=0`` (no pool before the first compile) leave nothing here to start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def start(device: str) -> None:
    """Start inductor's compile workers now, as torch does at its first compile, on a GPU
    (``device`` ``cuda...``), where the engines compile; nothing where torch would start none
    (no Triton, one compile thread, ``TORCH_WARM_POOL=0``)."""
    if not device.startswith("cuda"):
        return
    warm = getattr(_async_compile(), "maybe_warm_pool", None)
    if warm is not None:
        warm()


def release(device: str) -> bool:
    """Stop the compile workers, once they are up, and wait for their processes to end (about a
    second); whether they were stopped. Workers still starting are left to finish: stopping them
    would wait for their start. Inductor starts new ones at its next compile."""
    if not device.startswith("cuda"):
        return False
    module = _async_compile()
    # set when torch starts a pool, done once it is up
    ready = getattr(getattr(module, "AsyncCompile", None), "_ready_future", None)
    if ready is None or not ready.done():
        return False
    module.shutdown_compile_workers()
    return True


def _async_compile():
    """Inductor's ``async_compile`` module, whose functions torch itself uses around its compile
    workers (private to torch: a torch without them leaves the workers as torch runs them)."""
    try:
        from torch._inductor import async_compile
    except ImportError:
        return None
    return async_compile if hasattr(async_compile, "shutdown_compile_workers") else None


@contextmanager
def around_load(device: str, captures_at_start: bool) -> Iterator[None]:
    """The block with the compile workers started before it and, once up, let go after it, for a
    load that captures at start-up; else the workers run as torch runs them."""
    if not captures_at_start:
        yield
        return
    start(device)
    try:
        yield
    finally:
        release(device)
