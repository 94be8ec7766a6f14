"""torch.compile's compile workers around a load: started at once on a GPU, stopped once up.

Torch starts its compile-worker pool only where Triton is installed; no GPU is needed for
the pool itself, so these run wherever Triton imports."""
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="torch starts compile workers only where Triton is installed (the CPU torch "
                                     "of CI has none)")

from torch._inductor import async_compile  # noqa: E402

from edgeinfer.backends.torch import compile_workers  # noqa: E402


def children() -> list[int]:
    """Our child processes' ids (the pool's first process; its workers are its own children)."""
    me, out = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == me:
            out.append(int(entry.name))
    return out


def until(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def up() -> bool:
    ready = async_compile.AsyncCompile._ready_future
    return ready is not None and ready.done()


@pytest.fixture(autouse=True)
def no_pool_left():
    async_compile.shutdown_compile_workers()
    yield
    async_compile.shutdown_compile_workers()


@pytest.mark.skipif(async_compile.get_compile_threads() <= 1, reason="torch runs one compile thread here: no pool")
def test_a_load_s_workers_start_at_once_and_are_gone_once_released():
    assert children() == []
    compile_workers.start("cuda")
    assert children(), "no compile-worker process started"
    assert until(up, 120), "the compile workers did not come up in 120 s"
    assert compile_workers.release("cuda")
    assert until(lambda: children() == [], 10), f"processes left: {children()}"


@pytest.mark.skipif(async_compile.get_compile_threads() <= 1, reason="torch runs one compile thread here: no pool")
def test_workers_still_starting_are_left_to_start():
    compile_workers.start("cuda")
    assert not compile_workers.release("cuda")  # importing torch takes the new process seconds
    assert children()
    assert until(up, 120)
    assert compile_workers.release("cuda")


def test_a_cpu_load_starts_and_stops_nothing():
    compile_workers.start("cpu")
    assert children() == []
    assert not compile_workers.release("cpu")
