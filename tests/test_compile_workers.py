"""torch.compile's compile workers around a load that captures at start-up: started at once on a
GPU, stopped once up.

Torch starts its compile-worker pool only where Triton is installed; no GPU is needed for
the pool itself, so the tests that start one run wherever Triton imports."""
import importlib.util
import os
import time
from pathlib import Path

import pytest
from torch._inductor import async_compile

from edgeinfer.backends.torch import compile_workers
from edgeinfer.engine import EngineConfig

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="torch starts compile workers only where Triton is installed (the CPU torch "
                                         "of CI has none)")
pool = pytest.mark.skipif(async_compile.get_compile_threads() <= 1,
                          reason="torch runs one compile thread here: no pool")


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


@needs_triton
@pool
def test_a_load_s_workers_start_at_once_and_are_gone_once_released():
    assert children() == []
    compile_workers.start("cuda")
    assert children(), "no compile-worker process started"
    assert until(up, 120), "the compile workers did not come up in 120 s"
    assert compile_workers.release("cuda")
    assert until(lambda: children() == [], 10), f"processes left: {children()}"


@needs_triton
@pool
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


def test_only_a_gpu_load_that_captures_at_start_up_manages_the_workers():
    def captures(device, budget, cuda_graphs=True):
        return EngineConfig(device=device, capture_budget_s=budget, cuda_graphs=cuda_graphs).captures_at_start

    assert captures("cuda", 120.0) and captures("cuda:1", 0.5)
    assert not captures("cuda", 0.0)  # edgeinfer run, the benchmarks: its requests compile
    assert not captures("cpu", 120.0)
    assert not captures("cuda", 120.0, cuda_graphs=False)  # nothing captured, so its requests compile


@needs_triton
@pool
def test_a_load_that_captures_on_first_use_leaves_the_workers_to_torch():
    with compile_workers.around_load("cuda", captures_at_start=False):
        assert children() == [] and async_compile.AsyncCompile._ready_future is None
    with compile_workers.around_load("cuda", captures_at_start=True):
        assert children(), "a load that captures at start-up started no compile workers"
