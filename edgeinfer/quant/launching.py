"""What every module holding a low-bit kernel shares (:mod:`~edgeinfer.quant.kernels`,
:mod:`~edgeinfer.quant.staged`, the fused decode step): a packed weight as the kernels read it
(:class:`PackedGeometry`, :class:`PackedWeight`), how they launch (:func:`launch`, or only compile;
:func:`dependent_launch`, started before the kernel before has finished), the split products'
:class:`SplitWorkspace`, and the switches that change which kernels run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from edgeinfer.device import cuda_capability

try:  # grid dependency control (Triton 3.4 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton, or none
    gdc_launch_dependents = gdc_wait = None


@dataclass(frozen=True, slots=True)
class PackedGeometry:
    """What the kernels need to know of a packed weight besides its tensors."""

    n: int
    k: int
    bits: int
    groups: int
    group_constexpr: int  # the group size as the kernels read it (a power of two ≥ K for one group)


class PackedWeight(Protocol):
    """A packed weight as the kernels read it: a :class:`~edgeinfer.quant.packed.PackedMatrix`, or the
    product op's own tensors (:class:`PackedParts`)."""

    @property
    def codes(self) -> torch.Tensor: ...
    @property
    def scales(self) -> torch.Tensor: ...
    @property
    def zeros(self) -> torch.Tensor | None: ...
    @property
    def layout(self) -> PackedGeometry: ...


class PackedParts(NamedTuple):
    """A packed weight's tensors and geometry, as the product op is handed them."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    layout: PackedGeometry


# Set to 0 to launch every kernel after the one before it has finished, as a plain stream does.
DEPENDENT_LAUNCH_ENV = "EDGEINFER_DEPENDENT_LAUNCH"
# "0": the batch-1 tuner leaves out the staged products' tiles (quant/staged.py, fused into the step).
# On by default: on an H200 the step kept gate|up's staged tile and decode ran 1.02x faster; on an H100
# the step's descent took them out again, so there they cost only their timing (docs/gpu-kernels.md)
STAGED_ENV = "EDGEINFER_STAGED_PRODUCTS"
# "0": the batch-1 tuner leaves out the packed product's integer-dot tiles (x's columns as 16-bit integers
# dotted with the codes by dp2a: triton_decode.PackedGemvConfig.idot), which take bf16 and fp16 activations
INTEGER_DOT_ENV = "EDGEINFER_INTEGER_DOT"
# "1": the few-row tuner also times the tensor-core kernel's ``STAGED`` tiles (quant/tensor_core.py):
# right, but no faster at 16 rows on an H200, so off by default
STAGED_MMA_ENV = "EDGEINFER_STAGED_MMA"
# "0": the few-row tuner leaves out the staged kernel's tiles for 2 to 16 rows (quant/staged.py's
# staged_mm), which made batch-16 4-bit decode 1.03× faster on an H100 (docs/gpu-kernels.md)
STAGED_ROWS_ENV = "EDGEINFER_STAGED_ROWS"
# "0": 2 to 16 rows of 4-bit weights run the layer's own compiled products and norms, not the staged
# products with the norms, bias, residual and SiLU·up fused (triton_decode.FusedDecode.row_tiles)
FUSED_ROWS_ENV = "EDGEINFER_FUSED_ROWS"
# "0": the fused step's inputs (lookup, RoPE), greedy choice and final norm at several rows run as
# torch ops, not as one kernel each (backends/torch/step_ends.py)
STEP_ENDS_ENV = "EDGEINFER_STEP_ENDS"
# "1": the few-row layers' tiles are also chosen by whole-step time at each row tile's first use
# (triton_decode.FusedDecode._rows_in_step). Off by default: it adds up to the step budget to a row tile's
# first use, and on an H100 4-bit decode at batch 16 was no faster with it (docs/gpu-kernels.md)
ROWS_IN_STEP_ENV = "EDGEINFER_ROWS_IN_STEP"


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): the kernels run in numpy, for checks
    (and without inline assembly)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def staged_enabled() -> bool:
    """Whether the batch-1 tuner times the staged products' tiles (unless ``$EDGEINFER_STAGED_PRODUCTS=0``)."""
    return os.environ.get(STAGED_ENV, "1") != "0"


def integer_dot_enabled() -> bool:
    """Whether the batch-1 tuner times the packed product's integer-dot tiles (unless ``$EDGEINFER_INTEGER_DOT=0``)."""
    return os.environ.get(INTEGER_DOT_ENV, "1") != "0"


def staged_mma_enabled() -> bool:
    """Whether the few-row tuner times the tensor-core kernel's ``STAGED`` tiles (``$EDGEINFER_STAGED_MMA=1``)."""
    return os.environ.get(STAGED_MMA_ENV) == "1"


def staged_rows_enabled() -> bool:
    """Whether the few-row tuner times the staged kernel's tiles for 2 to 16 rows (unless
    ``$EDGEINFER_STAGED_ROWS=0``)."""
    return os.environ.get(STAGED_ROWS_ENV, "1") != "0"


def fused_rows_enabled() -> bool:
    """Whether 2 to 16 rows of 4-bit weights may run the fused staged products (unless
    ``$EDGEINFER_FUSED_ROWS=0``)."""
    return os.environ.get(FUSED_ROWS_ENV, "1") != "0"


def rows_in_step_enabled() -> bool:
    """Whether the few-row layers' tiles are chosen in the whole step too (``$EDGEINFER_ROWS_IN_STEP=1``)."""
    return os.environ.get(ROWS_IN_STEP_ENV) == "1"


def step_ends_enabled() -> bool:
    """Whether the fused step's inputs, greedy choice and final norm at several rows run as a kernel each
    (unless ``$EDGEINFER_STEP_ENDS=0``)."""
    return os.environ.get(STEP_ENDS_ENV, "1") != "0"


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents of the kernel before them.

    A decode step at batch 1 is a chain of short kernels, each of which waits for the one
    before it to finish and then for its first weights to arrive from memory. Launched as a
    dependent (Hopper and later), a kernel starts while the one before it finishes, reads its
    first tile of weights (which no kernel writes) and only then waits, in
    ``kernels.await_inputs``, for the results of the kernels before it. ``$EDGEINFER_DEPENDENT_LAUNCH=0``
    turns this off."""
    if device.type != "cuda" or interpreting() or gdc_wait is None:
        return False
    if os.environ.get(DEPENDENT_LAUNCH_ENV, "1") == "0":
        return False
    return cuda_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict[str, bool]:
    """A decode kernel's launch options: it starts as a programmatic dependent of the kernel before
    it where the device can (:func:`dependent_launch`); its ``PDL`` constexpr says so to the kernel."""
    pdl = dependent_launch(device)
    return {"PDL": pdl, "launch_pdl": pdl}


def launch(kernel, grid: tuple[int, ...], warmup: bool, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; with ``warmup`` only its compile (nothing runs), under the
    key the launch would look up (``kernels.compile_ahead``)."""
    if warmup:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


class SplitWorkspace:
    """The partial sums and arrival counts of split kernels (products, the decode step's attention),
    for one stream of kernels: kernels that run one after another share it (every kernel leaves
    its counts at zero). It grows outside captures only, and keeps the buffers it outgrew: a graph
    captured before keeps reading them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts = torch.empty(0, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(0, dtype=torch.int32, device=device)
        self._outgrown: list[torch.Tensor] = []

    def take(self, parts: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and (parts > self.parts.numel() or tiles > self.arrivals.numel()):
            raise RuntimeError("a split product's workspace must be sized before a capture")
        if parts > self.parts.numel():
            self._outgrown.append(self.parts)
            self.parts = torch.empty(parts, dtype=torch.float32, device=self.device)
        if tiles > self.arrivals.numel():
            self._outgrown.append(self.arrivals)
            self.arrivals = torch.zeros(tiles, dtype=torch.int32, device=self.device)
        return self.parts, self.arrivals


def pow2(n: int) -> int:
    """The least power of two ≥ ``n``."""
    return 1 << max(0, (n - 1).bit_length())
