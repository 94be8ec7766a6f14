"""Triton's kernel launches on a machine without a GPU: compiled for a chosen GPU, run nowhere.

Triton compiles on the CPU down to the GPU's binary (its wheel carries ``ptxas``), but a kernel's
wrapper reaches the compiler through a launch, and a launch first asks the active driver for the
device, its stream and its target. :func:`compile_only` answers those questions for a target
given, so that a wrapper called with ``warmup=True`` (:func:`edgeinfer.quant.kernels.launch`)
compiles what it would run there, with the arguments it would pass, and runs nothing.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator

try:  # the tests and probes that use this module skip or stop without Triton; the package imports anyway
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    GPUTarget = driver = None


class CompileOnlyDriver:
    """The three answers a Triton launch asks its driver for: device 0, a null stream, ``target``."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextlib.contextmanager
def compile_only(target: GPUTarget, kernels: Iterable) -> Iterator[None]:
    """Inside, launches compile for ``target`` (a warmup compiles; a real launch fails), and
    ``kernels`` (Triton JIT functions) keep what they compile in caches of their own, dropped after:
    a binary built for ``target`` is never found later by a launch on a real device 0."""
    kernels = list(kernels)
    saved_driver = driver._active  # None until a first launch asks: restored as it was, never created here
    saved_caches = [k.device_caches for k in kernels]
    driver.set_active(CompileOnlyDriver(target))
    for k in kernels:
        k.device_caches = defaultdict(k.create_binder)
    try:
        yield
    finally:
        driver._active = saved_driver
        for k, caches in zip(kernels, saved_caches):
            k.device_caches = caches


def binaries(kernels: Iterable) -> int:
    """How many binaries ``kernels`` hold for device 0, as their launches look them up."""
    return sum(len(k.device_caches[0][0]) for k in kernels if 0 in k.device_caches)
