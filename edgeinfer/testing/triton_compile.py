"""Triton's kernel launches on a machine without a GPU: compiled for a chosen GPU, run nowhere.

Triton compiles on the CPU down to the GPU's binary (its wheel carries ``ptxas``), but a kernel's
wrapper reaches the compiler through a launch, and a launch first asks the active driver for the
device, its stream and its target. :func:`compile_only` answers those questions for a target
given, so that a wrapper called with ``warmup=True`` (:func:`edgeinfer.quant.launching.launch`)
compiles what it would run there, with the arguments it would pass, and runs nothing.

:func:`disassembled`, :func:`resources`, :func:`instructions` and :func:`loops` read such a binary with the tools
Triton's wheel carries (``nvdisasm``, ``cuobjdump``): its instructions, its registers, its loops.
"""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

try:  # the tests and probes that use this module skip or stop without Triton; the package imports anyway
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = GPUTarget = driver = None


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


def _tool(name: str, binary: bytes, *flags: str) -> str:
    """The output of the wheel's ``name`` (nvdisasm, cuobjdump) run on ``binary`` (a cubin)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        return subprocess.run([str(tool), *flags, f.name], capture_output=True, text=True, check=True).stdout


def disassembled(binary: bytes) -> str:
    """``nvdisasm -c``'s listing of ``binary``."""
    return _tool("nvdisasm", binary, "-c")


def resources(binary: bytes) -> dict[str, int]:
    """Registers a thread (``REG``), bytes spilled (``STACK``) and static shared bytes (``SHARED``) of
    ``binary`` (``cuobjdump -res-usage``)."""
    usage = _tool("cuobjdump", binary, "-res-usage")
    return {key: int(n) for key, n in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}


_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;")


def instructions(listing: str) -> list[str]:
    """Every instruction of a :func:`disassembled` listing, in order."""
    return [op.group(1) for line in listing.splitlines() if (op := _INSTRUCTION.match(line)) is not None]


def loops(listing: str) -> list[list[str]]:
    """The body of each loop of a :func:`disassembled` listing, its instructions in order: a branch
    back to a label closes one, from the label to the branch."""
    ops, labels, bodies = [], {}, []
    for line in listing.splitlines():
        if (label := re.match(r"^\s*(\.L_x_\d+):", line)) is not None:
            labels[label.group(1)] = len(ops)
        elif (op := _INSTRUCTION.match(line)) is not None:
            ops.append(op.group(1))
            back = re.search(r"BRA\s+`\((\.L_x_\d+)\)", op.group(1))
            if back and labels.get(back.group(1), len(ops)) < len(ops):
                bodies.append(ops[labels[back.group(1)]:])
    return bodies


def opcodes(body: list[str], modifiers: bool = False) -> collections.Counter:
    """``body``'s instructions by opcode, predicate dropped: ``@!P0 LDG.E.128`` is ``LDG``, or with
    ``modifiers`` ``LDG.E.128`` (a load's width is its last modifier)."""
    names = (re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for op in body)
    return collections.Counter(name if modifiers else name.split(".")[0] for name in names)
