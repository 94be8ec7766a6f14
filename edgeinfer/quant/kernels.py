"""Triton kernels that read low-bit weights as they are stored and multiply in the activations' dtype.

The weight is a :class:`~edgeinfer.quant.packed.PackedMatrix`: ``codes`` int32 ``[N, K·b/32]``
(the 32/b unsigned b-bit values of each word are consecutive input columns, lowest bits
first), ``scales`` ``[N, groups]``, and ``zeros`` ``[N, groups]`` in the scales' dtype (absent:
the symmetric centre ``2^(b-1)``). Every kernel rebuilds the weight by the dequantization rule of
:meth:`QuantizedWeight.dequantize`, ``(q - z) · s``, so a product equals the product with the
dequantized dense weight up to summation order and rounding.

* :func:`load_words`, :func:`codes_less` (``q - z``, exact, by an and-or and an add),
  :func:`biased_codes_at` (``2^e + q``, for products that take the bias off once per word),
  :func:`group_params` (a scale per word) — a tile's codes, scales and zero points, shared with
  the fused batch-1 decode step. A K tile is read as 32/b interleaved column classes (value
  ``i`` of every word): a mask (and for the top values a shift) gives a class's codes in place;
* :func:`weight_tile` — a tile of weight put back in column order in registers;
* :func:`split_total` — a split product's partial sums added by the last split to arrive (here
  and in the fused batch-1 step);
* :func:`packed_mm` — ``x @ W.T`` for up to :data:`MAX_DOT_ROWS` rows: a tile of weight rebuilt
  in registers meets a tile of x in one tensor-core dot, the scale applied to the dot where the
  tile lies in one group; split along K when N alone gives too few programs to fill the GPU.
  For 4-bit weights and up to 16 rows it also times :mod:`~edgeinfer.quant.tensor_core`'s
  kernel (the weight rebuilt in the MMA's own registers) and, for 2 to 16 rows,
  :mod:`~edgeinfer.quant.staged`'s (every word of a program copied into shared memory at once),
  and keeps whichever is faster;
* :func:`dequantize` — the whole dense weight, for prompts (a GEMM then does the rest).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from edgeinfer import tile_cache
from edgeinfer.device import cuda_capability
from edgeinfer.progress import NoSteps, Steps
from edgeinfer.quant import staged, tensor_core
from edgeinfer.quant.launching import (PackedGeometry, PackedParts, SplitWorkspace, gdc_launch_dependents, gdc_wait,
                                       interpreting, launch, pow2, staged_mma_enabled, staged_rows_enabled)
from edgeinfer.quant.staged import StagedGemvConfig

try:  # the import decides whether these kernels exist at all
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = None

try:  # compiles handed to a pool of threads (Triton 3.4 and later; 3.6 and 3.9 tested)
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime._async_compile import active_mode as _async_compile_mode
except ImportError:  # pragma: no cover - older Triton, or none
    AsyncCompileMode = _async_compile_mode = None

# Set to 0 to compile each candidate tile at its first launch, one after another (compile_ahead off).
COMPILE_AHEAD_ENV = "EDGEINFER_COMPILE_AHEAD"
MAX_DOT_ROWS = 64  # rows past this take dequantize + GEMM: the tile of weight is then reused enough


def usable(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: a GPU this Triton can build for
    (:func:`cannot_build`), or Triton's CPU interpreter for checks."""
    if triton is None:
        return False
    if device.type == "cuda":
        return cannot_build(device) is None
    return device.type == "cpu" and interpreting()


def cannot_build(device: torch.device) -> str | None:
    """Why this Triton cannot build kernels for ``device``'s GPU, None where it can (or where
    ``device`` is not a GPU). A Triton's ``ptxas`` knows the GPUs of its CUDA: Jetson Thor is
    ``sm_110`` from CUDA 13 on, which Triton 3.9 builds for and 3.6 does not. Found once per
    GPU and process by building a kernel of one load and one store for it; the kernels that cannot be
    built are then not used (torch runs the products), rather than failing at their first launch."""
    if triton is None or device.type != "cuda":
        return None
    return _cannot_build_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache  # every packed product asks (usable): after the first, a lookup
def _cannot_build_on(index: int) -> str | None:
    with torch.cuda.device(index):  # Triton builds for the current device's target
        return _cannot_build_for(cuda_capability(torch.device("cuda", index)))


def _cannot_build_for(capability: tuple[int, int]) -> str | None:
    """What building :func:`_copy_one` for the active device's target (of ``capability``) raised, in
    a line; None if nothing."""
    try:  # Triton prints a failed build's whole PTX to stdout, where a command's answer goes
        with contextlib.redirect_stdout(io.StringIO()):
            _copy_one.warmup(torch.empty(1), torch.empty(1), grid=(1,))
    except Exception as e:  # noqa: BLE001 - whatever stops the build stops every kernel: it is the answer
        lines = str(e).splitlines() or [""]
        # ptxas's own verdict ("Value 'sm_110a' is not defined for option 'gpu-name'") names the GPU
        verdict = next((line.strip() for line in lines if "fatal" in line), lines[0])
        return f"{type(e).__name__}: {verdict}"[:300]
    return None


COMPILING = "compiling the tiles' kernels"  # the progress phase of compile_ahead


@dataclass(frozen=True, slots=True)
class CompiledAhead:
    """What :func:`compile_ahead` did: ``compiles`` handed to ``workers`` threads, in ``seconds``
    (a kernel already compiled, in this process or Triton's cache on disk, is no compile here)."""

    compiles: int
    workers: int
    seconds: float


def compile_ahead(warmups: Iterable[Callable[[], object]], steps: Steps | None = None,
                  workers: int | None = None) -> CompiledAhead | None:
    """Compile, on a pool of ``workers`` threads (one a core), the kernels that ``warmups`` (each a
    kernel's wrapper called with ``warmup=True``: its compile, no launch) name, before a tuner
    times them. Launched one after another, a tuner's tiles compiled one at a time: about a
    hundred of them, a second or more each, all in the first process on a GPU, and on a board's
    slower cores longer still. Triton's compiler spends most of a compile outside the GIL (MLIR,
    LLVM, ``ptxas``), so threads run them side by side; each compiled kernel goes into the
    kernel's own cache under the key its launch looks up, so the timings compile nothing.

    A compile that fails here is left for the launch to fail, where the caller handles it (the
    tensor-core kernel's refusal, say); nothing runs where Triton cannot compile ahead (no Triton,
    the interpreter, a Triton without asynchronous compiles, ``$EDGEINFER_COMPILE_AHEAD=0``: then
    None). ``steps`` hears of each compile done."""
    if triton is None or interpreting() or AsyncCompileMode is None or os.environ.get(COMPILE_AHEAD_ENV) == "0":
        return None
    done = (steps or NoSteps()).phase(COMPILING, None)
    workers = workers or len(os.sched_getaffinity(0))
    started = time.perf_counter()
    with _ReportingPool(workers, done) as pool:
        try:
            with AsyncCompileMode(pool, ignore_errors=True):
                _submit_all(warmups)
        except Exception:  # noqa: BLE001 - a compile hook that failed as it finished: launches compile what is left
            _async_compile_mode.set(None)  # Triton 3.6 leaves the mode set when its exit raises
    return CompiledAhead(pool.submitted, workers, round(time.perf_counter() - started, 2))


def _submit_all(warmups: Iterable[Callable[[], object]]) -> None:
    for warm in warmups:
        try:
            warm()
        except Exception:  # noqa: BLE001 - the same call fails again at its launch, where it is handled
            pass


class _ReportingPool(ThreadPoolExecutor):
    """A thread pool that calls ``done`` as each job ends."""

    def __init__(self, workers: int, done: Callable[[], None]) -> None:
        super().__init__(workers, thread_name_prefix="triton-compile")
        self._done = done
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(lambda _: self._done())
        return future


if triton is not None:

    @triton.jit
    def _copy_one(X, Y):
        """The smallest kernel a GPU build must take (:func:`cannot_build`)."""
        tl.store(Y, tl.load(X))

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """With ``PDL`` (a kernel launched as a programmatic dependent, :func:`dependent_launch`):
        waits until the kernels before this one have finished and their writes are visible, then
        lets the next kernel launch. The next one thus starts only once every kernel before this
        one has finished: before this call it may read anything but what this kernel writes
        (its weights and scales, the past of the KV pool, the block tables). Every program calls
        it before it writes anything."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def load_words(Q, rn, k0, N, K, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr):
        """The packed words of rows ``rn`` [BN] holding columns ``k0 .. k0+BK``: [BN, BK·b/32] int32
        (zero past the last row or column)."""
        PER: tl.constexpr = 32 // BITS
        words_per_row = K // PER
        rw = k0 // PER + tl.arange(0, BK // PER)
        ok = (rn[:, None] < N) & (rw[None, :] < words_per_row)
        return tl.load(Q + rn[:, None].to(tl.int64) * words_per_row + rw[None, :], mask=ok, other=0)

    @triton.jit
    def codes_less(words, i: tl.constexpr, BITS: tl.constexpr, z, ASM: tl.constexpr = False):
        """Value ``i`` of every word less ``z``, as float32 (exact for integer ``z``): an and-or and an add.

        The code is put in the mantissa of 2^E and ``2^E + z`` subtracted. A code whose bits lie
        below bit 23 of the word is masked where it is (``E = 23 - b·i``: its field is then the
        units of 2^E's mantissa), so it needs no shift; the others are shifted to the top of the
        mantissa (``E = b``). An and-or and an add run at full rate, where an integer-to-float
        conversion runs at a quarter of it."""
        F: tl.constexpr = BITS * i
        LOW: tl.constexpr = (1 << BITS) - 1
        if F + BITS <= 23:
            E: tl.constexpr = 23 - F
            MASK: tl.constexpr = LOW << F
            field = words
        else:
            E: tl.constexpr = BITS
            MASK: tl.constexpr = LOW << (23 - BITS)
            field = words >> (F - (23 - BITS))
        BIAS: tl.constexpr = 1 << E
        return and_or(field, MASK, (127 + E) << 23, ASM).to(tl.float32, bitcast=True) - (z + BIAS)

    @triton.jit
    def and_or(a, MASK: tl.constexpr, SET: tl.constexpr, ASM: tl.constexpr):
        """``(a & MASK) | SET``; with ``ASM`` one ``lop3`` (written as two ops, the compiler keeps
        both, since each takes one constant). Triton's CPU interpreter runs no inline assembly."""
        if ASM:
            return tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, $2, $3, 0xea;", "=r,r,r,r",
                [a, tl.full(a.shape, MASK, tl.int32), tl.full(a.shape, SET, tl.int32)],
                dtype=tl.int32, is_pure=True, pack=1)
        return (a & MASK) | SET

    @triton.constexpr_function
    def code_exponent(i, bits, wide):
        """``e`` of :func:`biased_codes_at`'s ``2^e + q`` for value ``i`` of a word of ``bits``-bit codes."""
        return 15 if wide else 8 - 4 * (i % 2) * (bits == 4)

    @triton.constexpr_function
    def _prmt_asm(selector):
        return f"prmt.b32 $0, $1, $2, {selector:#06x};"

    @triton.jit
    def prmt(a, b, SELECTOR: tl.constexpr, ASM: tl.constexpr):
        """Byte j of the result is ``a``'s byte (0-3) or ``b``'s (4-7) that ``SELECTOR``'s nibble j
        names: PTX ``prmt.b32`` in its default mode (no sign replicated); with ``ASM`` that one
        instruction, the selector written into it."""
        if ASM:
            return tl.inline_asm_elementwise(_prmt_asm(SELECTOR), "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                             pack=1)
        out = tl.zeros_like(a)
        for j in tl.static_range(4):
            src = (SELECTOR >> (4 * j)) & 7  # a constant once j is
            if src < 4:
                byte = (a >> (8 * src)) & 0xFF
            else:
                byte = (b >> (8 * (src - 4))) & 0xFF
            out = out | (byte << (8 * j))
        return out

    @triton.constexpr_function
    def _dp2a_asm(high):
        return f"dp2a.{'hi' if high else 'lo'}.s32.u32 $0, $1, $2, $3;"

    @triton.jit
    def dp2a(a, b, c, HIGH: tl.constexpr, ASM: tl.constexpr):
        """``c + a.lo·b[j] + a.hi·b[j + 1]``: ``a`` two signed 16-bit halves, ``b`` four unsigned bytes,
        ``j`` 2 with ``HIGH`` else 0; PTX ``dp2a`` (sm_61 and later, Orin's sm_87 included), one
        instruction, with ``ASM``; the same integers by shifts and masks in Triton's CPU interpreter."""
        if ASM:
            return tl.inline_asm_elementwise(_dp2a_asm(HIGH), "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True,
                                             pack=1)
        SHIFT: tl.constexpr = 16 if HIGH else 0
        return c + ((a << 16) >> 16) * ((b >> SHIFT) & 0xFF) + (a >> 16) * ((b >> (SHIFT + 8)) & 0xFF)

    @triton.jit
    def as_int16(x, inv):
        """``round(x·inv)`` for ``|x·inv| <= 32767``: as the low 16 bits of an int32 (two's complement), and
        as a float. Adding 1.5·2^23 rounds the value into the float's mantissa, so its low 16 bits are the
        integer's; taking 1.5·2^23 off again gives it exactly."""
        t = x * inv + 12582912.0
        return t.to(tl.int32, bitcast=True), t - 12582912.0

    @triton.jit
    def biased_codes_at(words, i: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, WIDE: tl.constexpr = False,
                        exponent=None):
        """Value ``i`` of every word as a float32 ``2^e + q`` (``e`` from :func:`code_exponent`), by a
        shift and an and-or, or with ``WIDE`` by one byte permute.

        The code is moved into the top mantissa bits of 2^e: 4-bit codes sit at bits 15-18
        (``e`` 8) and 19-22 (``e`` 4), so two values come out of one shifted copy of the word;
        8-bit codes at bits 15-22. ``2^e + q`` has at most 9 significant bits, so its product with
        a 16-bit float (at most 11) is exact in float32: a product can take the biased values as
        they are and take ``Σ 2^e·x`` off once per word, where :func:`codes_less` subtracts 2^E
        from every value.

        ``WIDE`` (8-bit codes, bf16 activations): one ``prmt`` puts byte ``i`` in bits 8-15 and takes
        the other three bytes from ``exponent`` (2^15's bits, held in a register): ``2^15 + q`` has 16
        significant bits and a bf16 value 8, so the product is still exact."""
        E: tl.constexpr = code_exponent(i, BITS, WIDE)
        MAGIC: tl.constexpr = (127 + E) << 23
        if WIDE:  # result bytes: exponent's byte 0 (zero), code i, exponent's bytes 2 (zero) and 3
            SELECTOR: tl.constexpr = 4 | (i << 4) | (6 << 8) | (7 << 12)
            return prmt(words, exponent, SELECTOR, ASM).to(tl.float32, bitcast=True)
        FIELD: tl.constexpr = 23 - E
        SHIFT: tl.constexpr = FIELD - BITS * i
        if SHIFT >= 0:
            moved = words << SHIFT
        else:
            moved = words >> (-SHIFT)
        MASK: tl.constexpr = ((1 << BITS) - 1) << FIELD
        return and_or(moved, MASK, MAGIC, ASM).to(tl.float32, bitcast=True)

    @triton.jit
    def group_params(S, Z, rn, k0, N, G, BK: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                     HAS_Z: tl.constexpr, EVEN: tl.constexpr = False):
        """Scale and zero point (float32) of every word of the tile, [BN, BK·b/32]; the 32/b values
        of a word share a group (groups are 32 columns or more). ``EVEN``: every row and group of
        the tile exists (no bounds checks)."""
        PER: tl.constexpr = 32 // BITS
        return params_at(S, Z, rn, (k0 + tl.arange(0, BK // PER) * PER) // GS, N, G, BITS, HAS_Z, EVEN)

    @triton.jit
    def params_at(S, Z, rn, g, N, G, BITS: tl.constexpr, HAS_Z: tl.constexpr, EVEN: tl.constexpr):
        """Scale and zero point (float32) of rows ``rn`` [BN] in groups ``g`` [W], [BN, W]; zero
        points 2^(b-1) (symmetric) without ``HAS_Z``."""
        at = rn[:, None] * G + g[None, :]
        ok = (rn[:, None] < N) & (g[None, :] < G)
        return params_from(S + at, Z + at, ok, BITS, HAS_Z, EVEN)

    @triton.jit
    def params_from(S_AT, Z_AT, ok, BITS: tl.constexpr, HAS_Z: tl.constexpr, EVEN: tl.constexpr):
        """The scales and zero points (float32) at addresses ``S_AT`` and ``Z_AT``, zero where ``ok``
        is false (``EVEN``: all exist, read unchecked); zero points 2^(b-1) (symmetric) without
        ``HAS_Z``."""
        s = load_where(S_AT, ok, EVEN).to(tl.float32)
        if HAS_Z:
            z = load_where(Z_AT, ok, EVEN).to(tl.float32)
        else:
            z = tl.zeros_like(s) + (1 << (BITS - 1))
        return s, z

    @triton.jit
    def load_where(at, ok, EVEN: tl.constexpr):
        """The values at ``at``, zero where ``ok`` is false; ``EVEN``: all exist, read unchecked."""
        if EVEN:
            return tl.load(at)
        return tl.load(at, mask=ok, other=0.0)

    @triton.jit
    def arrived_last(ARRIVALS, at, splits):
        """Counts this program in ``ARRIVALS[at]`` once every thread's partial results are stored, and
        returns whether it is the last of ``splits`` to arrive (then every other's partials are
        visible to it: read them through L2, ``.cg``). The last sets the count back to zero once it
        has read them, so the next kernel (or graph replay) through the same counts starts clean."""
        tl.debug_barrier()  # every thread's partials are written before the count says so
        return tl.atomic_add(ARRIVALS + at, 1, sem="acq_rel") == splits - 1

    @triton.jit
    def split_total(acc, PARTS, ARRIVALS, at, ok, tile, split, splits, split_stride):
        """For a product whose K is split ``splits`` ways: stores this split's partial sums ``acc``
        at ``PARTS + split·split_stride + at`` and counts them in ``ARRIVALS[tile]``. Returns
        whether this split arrived last and, for the last, the sum of every split's partials in
        split order (the same sum whichever arrives last); the last sets the count back to zero,
        so the next product (or graph replay) through the same counts starts clean."""
        tl.store(PARTS + split * split_stride + at, acc, mask=ok)
        last = arrived_last(ARRIVALS, tile, splits)
        total = tl.zeros_like(acc)
        if last:
            for j in range(0, splits):
                total += tl.load(PARTS + j * split_stride + at, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(ARRIVALS + tile, 0)
        return last, total

    @triton.jit
    def _packed_mm_kernel(X, Q, S, Z, Y, PARTS, ARRIVALS, M, N, K, G, stride_x, stride_y, splits,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                          BITS: tl.constexpr, GS: tl.constexpr, HAS_Z: tl.constexpr, IEEE: tl.constexpr,
                          W_A: tl.constexpr, ASM: tl.constexpr):
        """Y[m, n] = sum_k X[m, k] * W[n, k] over a tile of Y, K split ``splits`` ways (``SPLIT_K``).

        A K tile of weight is rebuilt in column order in registers (:func:`weight_tile`) and
        meets a contiguous tile of X in one tensor-core dot (``W_A``: the weight as the dot's
        first operand, the output tile transposed). Where the tile lies in one group, its
        values are the exact integers ``q - z`` and the scale multiplies the tile's dot, once an
        output, not once a weight (16-bit activations only). Split, each program writes its partial sums to ``PARTS`` and
        counts itself in ``ARRIVALS``; the last of a tile's splits to arrive adds the partials in
        split order, writes the tile and sets the count back to zero (no second kernel to add
        the splits)."""
        # Every K tile lies in one group: its scale waits for the dot. float32 activations take the
        # dequantized weight itself, as the dense product does (their tokens are compared exactly).
        GROUPED: tl.constexpr = GS % BK == 0 and not IEEE
        dt = X.dtype.element_ty
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        per_split = tl.cdiv(tl.cdiv(K, BK), splits) * BK
        start = split * per_split
        if W_A:
            acc = tl.zeros([BN, BM], tl.float32)
        else:
            acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(start, tl.minimum(start + per_split, K), BK):
            words = load_words(Q, rn, k0, N, K, BN, BK, BITS)
            rk = k0 + tl.arange(0, BK)
            x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            if GROUPED:
                at = rn * G + k0 // GS
                s = tl.load(S + at, mask=n_ok, other=0.0).to(tl.float32)
                if HAS_Z:
                    z = tl.load(Z + at, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                else:
                    z = 1 << (BITS - 1)
                w = weight_tile(words, z, 1.0, BITS, False, S.dtype.element_ty, dt, ASM)
            else:
                s, z = group_params(S, Z, rn, k0, N, G, BK, BITS, GS, HAS_Z)
                w = weight_tile(words, z, s, BITS, True, S.dtype.element_ty, dt, ASM)
            if W_A:
                part = _dot(w, tl.trans(x), IEEE)
                if GROUPED:
                    part = part * s[:, None]
            else:
                part = _dot(x, tl.trans(w), IEEE)
                if GROUPED:
                    part = part * s[None, :]
            acc += part
        if W_A:
            at = rm[None, :] * N + rn[:, None]
            out = Y + rm[None, :] * stride_y + rn[:, None]
            ok = (rm[None, :] < M) & n_ok[:, None]
        else:
            at = rm[:, None] * N + rn[None, :]
            out = Y + rm[:, None] * stride_y + rn[None, :]
            ok = (rm[:, None] < M) & n_ok[None, :]
        if not SPLIT_K:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)
        else:
            last, total = split_total(acc, PARTS, ARRIVALS, at, ok, pid_m * tl.num_programs(0) + pid_n, split,
                                      splits, M * N)
            if last:
                tl.store(out, total.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """``a @ b`` on the tensor cores, float32 ones at full precision with ``IEEE``."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def weight_tile(words, z, s, BITS: tl.constexpr, SCALED: tl.constexpr, sdt: tl.constexpr, dt: tl.constexpr,
                    ASM: tl.constexpr):
        """The weights of ``words`` [R, W] in column order, [R, W·32/b] in ``dt``: ``q - z`` (exact
        integers), or with ``SCALED`` the dequantized ``(q - z)·s`` rounded to the scales' dtype.
        ``z`` and ``s`` broadcast against the words (a value per word, per row, or one)."""
        if BITS == 4:
            evens = _join4(_value(words, 0, z, s, BITS, SCALED, sdt, dt, ASM),
                           _value(words, 2, z, s, BITS, SCALED, sdt, dt, ASM),
                           _value(words, 4, z, s, BITS, SCALED, sdt, dt, ASM),
                           _value(words, 6, z, s, BITS, SCALED, sdt, dt, ASM))
            odds = _join4(_value(words, 1, z, s, BITS, SCALED, sdt, dt, ASM),
                          _value(words, 3, z, s, BITS, SCALED, sdt, dt, ASM),
                          _value(words, 5, z, s, BITS, SCALED, sdt, dt, ASM),
                          _value(words, 7, z, s, BITS, SCALED, sdt, dt, ASM))
            tile = tl.join(evens, odds)
        else:
            tile = _join4(_value(words, 0, z, s, BITS, SCALED, sdt, dt, ASM),
                          _value(words, 1, z, s, BITS, SCALED, sdt, dt, ASM),
                          _value(words, 2, z, s, BITS, SCALED, sdt, dt, ASM),
                          _value(words, 3, z, s, BITS, SCALED, sdt, dt, ASM))
        R: tl.constexpr = words.shape[0]
        C: tl.constexpr = words.shape[1] * (32 // BITS)
        return tl.reshape(tile, [R, C])

    @triton.jit
    def _value(words, i: tl.constexpr, z, s, BITS: tl.constexpr, SCALED: tl.constexpr, sdt: tl.constexpr,
               dt: tl.constexpr, ASM: tl.constexpr):
        """Value ``i`` of every word as :func:`weight_tile` gives it."""
        v = codes_less(words, i, BITS, z, ASM)
        if SCALED:
            v = (v * s).to(sdt)
        return v.to(dt)

    @triton.jit
    def _dequantize_kernel(Q, S, Z, W, N, K, G, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr,
                           GS: tl.constexpr, HAS_Z: tl.constexpr, ASM: tl.constexpr):
        """W[n, k] = (q - z) · s for a [BN, BK] tile, stored contiguous (the tile is put back in
        column order in registers: a store per class would write every row 32/b times, a value
        at a time)."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        k0 = tl.program_id(1) * BK
        words = load_words(Q, rn, k0, N, K, BN, BK, BITS)
        s, z = group_params(S, Z, rn, k0, N, G, BK, BITS, GS, HAS_Z)
        w = weight_tile(words, z, s, BITS, True, S.dtype.element_ty, W.dtype.element_ty, ASM)
        rk = k0 + tl.arange(0, BK)
        tl.store(W + rn[:, None].to(tl.int64) * K + rk[None, :], w, mask=(rn[:, None] < N) & (rk[None, :] < K))

    @triton.jit
    def _join4(a, b, c, d):
        """[R, W] four times -> [R, W, 4], entry ``i`` of the last axis from the ``i``-th argument
        (a join puts its two parts on a new last axis: join(join(a, c), join(b, d)) reads a, b, c, d)."""
        R: tl.constexpr = a.shape[0]
        W: tl.constexpr = a.shape[1]
        return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), [R, W, 4])


@dataclass(frozen=True, slots=True)
class MmConfig:
    bn: int
    bk: int
    split: int
    warps: int = 4
    stages: int = 3
    w_a: bool = False  # the weight as the dot's first operand
    mma: bool = False  # the tensor-core kernel of :mod:`edgeinfer.quant.tensor_core` (4-bit, ≤ 16 rows)
    x_shared: bool = False  # that kernel with x put in shared memory once a CTA (``X_SHARED``)
    wide: bool = False  # that kernel with a lane's words of a step side by side, one load (``WIDE``)
    staged: bool = False  # that kernel with every step's words copied into shared memory at once (``STAGED``)


@functools.cache
def _workspace(device: torch.device) -> SplitWorkspace:
    """The split products' workspace of :func:`packed_mm` on ``device`` (one stream of kernels)."""
    return SplitWorkspace(device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile_k(layout: PackedGeometry, want: int) -> int:
    """A K tile of ``want`` columns, or of the row where it is shorter (at least 32: a dot's least K
    is 16, and a tile holds whole words)."""
    return max(32, min(want, pow2(layout.k)))


def _grouped_tiles(layout: PackedGeometry) -> list[int]:
    """K tiles (64 to 256 columns) that each lie in one group, so that :func:`packed_mm` multiplies
    by the scale once per output; the group itself where groups are shorter."""
    g = layout.group_constexpr
    tiles = sorted({_tile_k(layout, t) for t in (64, 128, 256) if g % _tile_k(layout, t) == 0})
    return tiles[-2:] or [_tile_k(layout, g)]


def mm_config(layout: PackedGeometry, rows: int, device: torch.device) -> MmConfig:
    """Tiles for ``rows`` rows: N tiles of 32 or 64 outputs, the weight as the dot's first operand,
    and K split until there are about two programs per multiprocessor (a decode product has few
    outputs and a long K)."""
    bn = 64 if layout.n >= 4096 else 32
    bk = _grouped_tiles(layout)[-1]
    programs = triton.cdiv(layout.n, bn) * triton.cdiv(rows, max(16, pow2(rows)))
    split = 1
    while programs * split < 2 * _sm_count(device) and layout.k // (bk * split * 2) >= 2:
        split *= 2
    return MmConfig(bn, bk, split, w_a=True)


def mm_candidates(layout: PackedGeometry) -> list[MmConfig]:
    """The tiles :func:`tuned_config` times: N tiles of 32 and 64 outputs (and 128 for a vocabulary's
    many), the two longest K tiles that lie in one group, K split up to eight ways where the row is
    long enough, and either operand order (Hopper runs the weight-first dot as one ``wgmma``)."""
    out = []
    for bn in (32, 64, 128) if layout.n >= 65536 else (32, 64):
        for bk in _grouped_tiles(layout):
            for split in (1, 2, 4, 8):
                if split == 1 or layout.k >= bk * split:
                    out.extend(MmConfig(bn, bk, split, w_a=w_a) for w_a in (False, True))
    return out


def mma_candidates(layout: PackedGeometry, row_tile: int) -> list[MmConfig]:
    """The tensor-core kernel's tiles :func:`tuned_config` times beside :func:`mm_candidates`.

    For a row tile of 8: 64 to 256 outputs a program (16 a warp, repeated), K steps of 64 (and 128
    where groups are that long), K split up to 16 ways where the row has that many steps, and the next
    one or three steps' operands in flight (``stages`` 2 or 4). On an H200 the fastest for
    Qwen2-VL-2B's products at 1 to 16 rows were among these, and none of them everywhere: one step
    ahead for gate|up (more costs it registers), three for q|k|v and down.

    For a row tile of 16, the same kernel with x in shared memory instead (:data:`X_SHARED_TILES`,
    where a split's x takes at most :data:`X_SHARED_BYTES`): there the kernel that reads x from memory
    each step was slower than the dot kernel on every product of the H200's sweep, x's steps held
    ahead being most of a thread's registers. At 8 rows x holds half as many, and those tiles were
    the fastest at 1 to 4 rows; each tile timed is a compile at first use, so the shared ones are not
    timed there. Beside them at 16 rows, the two tiles of :data:`ROW16_REGISTER_TILES`, which were the
    fastest of all at 16 rows in the H200's later probe, once a lane read its words side by side."""
    def fits(bk: int, split: int) -> bool:
        return layout.k // bk >= split and layout.group_constexpr % bk == 0

    registers = [MmConfig(bn, bk, split, stages=stages, mma=True) for bn, bk, split in MMA_TILES
                 for stages in (2, 4) if row_tile <= 8 and fits(bk, split)]
    shared = [MmConfig(bn, bk, split, stages=stages, mma=True, x_shared=True) for bn, bk, split in X_SHARED_TILES
              for stages in (2, 4)
              if row_tile == 16 and fits(bk, split) and x_shared_bytes(layout.k, bk, split, row_tile) <= X_SHARED_BYTES]
    row16 = [c for c in ROW16_REGISTER_TILES if row_tile == 16 and fits(c.bk, c.split)]
    return registers + shared + row16 + (staged_mma_candidates(layout, row_tile) if staged_mma_enabled() else [])


def staged_rows_candidates(x: torch.Tensor, codes, scales, zeros, layout: PackedGeometry) -> list[StagedGemvConfig]:
    """The staged kernel's tiles (:func:`staged.staged_mm`) that :func:`tuned_config` times for ``x``'s
    2 to 16 rows, unless ``$EDGEINFER_STAGED_ROWS=0``, where the kernel can run here and take this
    product (4-bit, bf16 or fp16, groups of 128 columns or more; :func:`staged.unfit`)."""
    if not staged_rows_enabled() or not 1 < x.shape[0] <= staged.MAX_ROWS or staged.unavailable(x.device) is not None:
        return []
    return staged.tiles_that_fit(PackedParts(codes, scales, zeros, layout), x.dtype, False)


def staged_mma_candidates(layout: PackedGeometry, row_tile: int) -> list[MmConfig]:
    """The tensor-core kernel's staged tiles (``STAGED``: every step's words and x in shared memory at
    once; right on an H200, but not faster at 16 rows there): 64 and 128 outputs, steps of 128
    columns with a lane's words side by side (16-byte copies), each at the :data:`STAGED_SPLITS`
    fewest splits that leave every split the same steps, at least two, in :data:`STAGED_BYTES` of
    shared memory (:func:`staged_bytes`)."""
    bk = 128
    if layout.k % bk or layout.group_constexpr % bk:
        return []
    steps = layout.k // bk
    out = []
    for bn in (64, 128):
        fits = [split for split in range(1, steps // 2 + 1) if steps % split == 0
                and staged_bytes(layout.k, bn, bk, split, row_tile) <= STAGED_BYTES]
        out += [MmConfig(bn, bk, split, stages=2, mma=True, x_shared=True, wide=True, staged=True)
                for split in fits[:STAGED_SPLITS]]
    return out


STAGED_SPLITS = 2
STAGED_BYTES = 96 * 1024  # under half of an H200 SM's shared memory, and of an Orin SM's 164 KB


def staged_bytes(k: int, bn: int, bk: int, split: int, row_tile: int) -> int:
    """The shared memory a CTA of the staged tensor-core kernel takes: its steps' words and x."""
    return k // bk // split * bn * bk // 2 + x_shared_bytes(k, bk, split, row_tile)


MMA_TILES = ((64, 64, 1), (64, 64, 4), (64, 64, 8), (128, 64, 4), (128, 64, 8), (128, 64, 16), (256, 64, 4),
             (256, 64, 8), (64, 128, 4), (128, 128, 4), (128, 128, 8))
# The tiles with x in shared memory: fewer registers a thread (sm_90, Triton 3.6, 128×64 two steps
# ahead at 16 rows: 100 against 128, and a K step of 252 instructions against 305;
# scripts/probe_sass_loops.py --tensor-core), for up to 64 KB of shared memory a CTA (under a third
# of an H200 SM's, of an Orin SM's 164 KB). Five tiles, ten with the steps ahead: each is a compile
# at a shape's first use, on a Jetson's few cores too.
# At 16 rows, x read from memory each step: the fastest tile of gate|up (128×64, split 4, a lane's
# words side by side, one step ahead: 14.89 µs against 15.73 for the best shared tile) and of down
# (64×64, split 8, three steps ahead: 14.81 against 15.27 and more) on the H200
# (docs/results/probes/h200-staged-gemv/second-call/probe-packed-mm.json, one mean of 10 replays a tile).
ROW16_REGISTER_TILES = (MmConfig(128, 64, 4, stages=2, mma=True, wide=True), MmConfig(64, 64, 8, stages=4, mma=True))
X_SHARED_TILES = ((64, 64, 2), (128, 64, 2), (128, 64, 4), (128, 64, 8), (128, 128, 4))
X_SHARED_BYTES = 64 * 1024


def x_shared_bytes(k: int, bk: int, split: int, row_tile: int) -> int:
    """The shared memory x takes in a CTA of the tensor-core kernel with ``X_SHARED``: a split's steps
    (rounded up to a power of two, as Gluon's buffers are) × a step's [bk, row tile] of 16-bit values."""
    steps = -(-(k // bk) // split)
    return pow2(steps) * bk * row_tile * 2


def dequantize_with_torch(codes, scales, zeros, layout: PackedGeometry, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[N, K]`` weight by plain torch ops: where Triton is missing, and the kernels' reference."""
    shifts = torch.arange(0, 32, layout.bits, dtype=torch.int32, device=codes.device)
    u = ((codes.unsqueeze(-1) >> shifts) & ((1 << layout.bits) - 1)).reshape(layout.n, -1)[:, :layout.k]
    group = torch.arange(layout.k, device=codes.device) // layout.group_constexpr
    z = zeros[:, group] if zeros is not None else torch.tensor(1 << (layout.bits - 1), dtype=scales.dtype)
    return ((u.to(scales.dtype) - z) * scales[:, group]).to(dtype)


CHECKED_OUTPUTS = 128  # outputs a tile's check reads at each end of N and spread between


def checked_outputs(n: int) -> torch.Tensor:
    """The outputs a tile is checked on before it is timed: the first and last
    :data:`CHECKED_OUTPUTS` (tiles cut short at N's end) and as many spread between (later tiles)."""
    spread = torch.linspace(0, n - 1, CHECKED_OUTPUTS).round().long()
    ends = torch.cat([torch.arange(min(n, CHECKED_OUTPUTS)), torch.arange(max(0, n - CHECKED_OUTPUTS), n)])
    return torch.unique(torch.cat([ends, spread]))


def reference_outputs(x: torch.Tensor, codes, scales, zeros, layout: PackedGeometry,
                      outputs: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` at ``outputs`` (columns of the result) by torch, in float32 with the weight rounded
    once in the scales' dtype and the result once in x's: what every tile must give, up to summation
    order. Only those rows of W are dequantized (a vocabulary's head whole would be gigabytes)."""
    w = dequantized_rows(codes, scales, zeros, layout, outputs.to(codes.device))
    return (x.float() @ w.float().t()).to(x.dtype).float()


def dequantized_rows(codes, scales, zeros, layout: PackedGeometry, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the dense weight, in the scales' dtype (:func:`dequantize_with_torch`)."""
    picked = PackedGeometry(len(rows), layout.k, layout.bits, layout.groups, layout.group_constexpr)
    return dequantize_with_torch(codes[rows], scales[rows], None if zeros is None else zeros[rows], picked,
                                 scales.dtype)


def divergence(got: torch.Tensor, want: torch.Tensor, outputs: torch.Tensor | None = None) -> str | None:
    """None where ``got`` equals ``want`` within a 16-bit float's rounding, else where they first
    part (``outputs``: the output each column is). The bounds are 2^-5 of an output, and 2^-7 of the
    largest near zero: a fused product rounds up to four times in bf16 (the product, its bias, SiLU,
    the product with up), each a unit in the last place at most, 2^-7 of a value at worst. A wrong
    row, column, group or nibble moves whole outputs, far past that."""
    got = got.float()
    close = torch.isclose(got, want, rtol=2 ** -5, atol=2 ** -7 * want.abs().max().item())
    if bool(close.all()):
        return None
    first = int((~close).flatten().nonzero()[0])
    row, column = divmod(first, want.shape[1])
    output = column if outputs is None else int(outputs[column])
    return f"row {row}, output {output}: {got[row, column].item():.6g} where {want[row, column].item():.6g}"


def graph_time_us(calls: list, repeats: int = 5) -> float:
    """Device microseconds per call of ``calls`` (functions), replayed from one CUDA graph so that
    launches cost what they cost in the decode step's graph."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return replay_ms(graph, repeats) / len(calls) * 1e3


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Device milliseconds of one replay of ``graph``, over ``replays`` back to back after one
    untimed (the first replay uploads the graph)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def cold_copies(nbytes: int, l2_bytes: int) -> int:
    """How many copies of a weight of ``nbytes`` (the weight itself counted) a timing goes through so
    that none is still in an L2 cache of ``l2_bytes`` when it is read again, as a decode step reads
    each weight once among far more bytes: three times the cache together, at most 256 copies, and
    the weight alone where it is that large already (no copy: a Jetson's L2 is a few MB)."""
    return max(1, min(256, -(-3 * l2_bytes // max(1, nbytes))))


# Tile choices by (layout, row tile, device), timed on first use outside a CUDA graph capture (a
# capture uses the heuristic until then) and kept in the tile cache for later processes on the same
# GPU and kernels (:mod:`edgeinfer.tile_cache`): Triton's own autotuner keeps its choices per kernel
# and key the same way, in one process. Timed as the decode step runs them: back to back from a CUDA
# graph, each call on weights the L2 cache does not hold. Timing single calls with events
# (``triton.testing.do_bench``) picked tiles up to 2.4× slower than the best on an H200: a few-µs
# kernel is lost in the events' own cost.
_TUNED: dict[tuple, MmConfig | StagedGemvConfig | None] = {}
_REFUSED: dict[tuple, str] = {}  # why the tensor-core kernel failed to compile or run, by the same key
_WRONG: dict[tuple, dict[MmConfig | StagedGemvConfig, str]] = {}  # tiles whose outputs were not torch's, and where, by the same key
_FROM_CACHE: set[tuple] = set()  # choices an earlier process made (:mod:`edgeinfer.tile_cache`), by the same key
PACKED_TILES = "packed-mm"  # the tile cache's kind for these choices


def row_tile(rows: int) -> int:
    """The rows a tuned tile serves: 1 (a staged tile takes 2 or more), up to 8 and 16 (the tensor-core
    kernel's row tiles), then powers of two."""
    return 1 if rows == 1 else 8 if rows <= 8 else max(16, pow2(rows))


def tuned_config(x: torch.Tensor, codes, scales, zeros, layout: PackedGeometry) -> MmConfig | StagedGemvConfig | None:
    """The fastest of :func:`mm_candidates` (and, where they can run, :func:`mma_candidates` and
    :func:`staged_rows_candidates`) for ``x``'s :func:`row_tile` on this device, each timed over
    :func:`cold_copies` copies of the weight replayed from a CUDA graph (the copies live for the
    timing only: three times the L2 cache at most).

    Each tile is first checked against torch (:func:`reference_outputs`, on random rows of x's
    shape): one that gives other outputs, as a miscompiled or misbuilt kernel would, is not timed and
    never chosen, and why is kept for the report. None where no tile is right: :func:`packed_mm` then
    multiplies by the dequantized weight, slowly but correctly (a warning says so)."""
    bm = row_tile(x.shape[0])
    key = (layout, bm, zeros is not None, x.dtype, x.device)
    if key in _TUNED:
        return _TUNED[key]
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return mm_config(layout, x.shape[0], x.device)
    cache, ident = tile_cache.default(), tile_cache.device_identity(x.device)
    cache_key = {**asdict(layout), "row_tile": bm, "zeros": zeros is not None, "dtype": str(x.dtype),
                 "staged": staged_mma_enabled(),  # whether the tensor-core STAGED tiles were candidates
                 "staged_rows": staged_rows_enabled()}
    kept = _kept_config(cache.get(PACKED_TILES, cache_key, ident))
    if kept is not None:
        _TUNED[key] = kept
        _FROM_CACHE.add(key)
        return kept
    candidates: list[MmConfig | StagedGemvConfig] = mm_candidates(layout)
    if tensor_core.unavailable(x, scales.dtype, layout.bits, layout.group_constexpr, layout.n, layout.k) is None:
        candidates += mma_candidates(layout, bm)
    candidates += staged_rows_candidates(x, codes, scales, zeros, layout)
    compile_ahead(lambda cfg=cfg: packed_mm(x, codes, scales, zeros, layout, cfg, warmup=True) for cfg in candidates)
    candidates = _right_tiles(key, candidates, x, codes, scales, zeros, layout)
    if not candidates:
        _TUNED[key] = None
        warnings.warn(f"{_why_no_tile(key)} for the {layout.bits}-bit {layout.n}×{layout.k} product at {bm} rows: "
                      "it multiplies by the dequantized weight")
        return None
    nbytes = sum(t.numel() * t.element_size() for t in (codes, scales, zeros) if t is not None)
    weights = [(codes, scales, zeros)] + [
        (codes.clone(), scales.clone(), None if zeros is None else zeros.clone())
        for _ in range(cold_copies(nbytes, torch.cuda.get_device_properties(x.device).L2_cache_size) - 1)]
    times = {}
    for cfg in candidates:
        try:
            times[cfg] = graph_time_us([lambda w=w, cfg=cfg: packed_mm(x, *w, layout, cfg) for w in weights])
        except Exception as e:  # Gluon is experimental: a Triton that refuses the kernel keeps the Triton one
            if not _gluon(cfg):
                raise
            _REFUSED[key] = refusal(e)
    _TUNED[key] = min(times, key=times.get)
    cache.put(PACKED_TILES, cache_key, _cache_fields(_TUNED[key]), ident)
    return _TUNED[key]


def _why_no_tile(key: tuple) -> str:
    """Why no tile is left for ``key``: the first whose outputs were wrong, else the one a compiler
    refused, else that none was offered."""
    if wrong := _WRONG.get(key):
        first = next(iter(wrong))
        return f"every tile gave wrong outputs on this GPU (tile {_tile_name(first)}: {wrong[first]})"
    if key in _REFUSED:
        return f"every tile was refused on this GPU ({_REFUSED[key]})"
    return "no tile is offered"


def _right_tiles(key: tuple, candidates: list[MmConfig], x: torch.Tensor, codes, scales, zeros,
                 layout: PackedGeometry) -> list[MmConfig]:
    """The candidates whose outputs equal torch's (:func:`divergence`) on random rows of ``x``'s shape
    and dtype; the others' first divergence goes to ``_WRONG[key]``, a tensor-core tile that fails to
    build or run to ``_REFUSED[key]``."""
    check = torch.randn(x.shape, generator=torch.Generator(x.device).manual_seed(0), device=x.device).to(x.dtype)
    outputs = checked_outputs(layout.n)

    def product(cfg: MmConfig) -> torch.Tensor | None:
        try:
            return packed_mm(check, codes, scales, zeros, layout, cfg)
        except Exception as e:  # Gluon is experimental: a Triton that refuses the kernel keeps the Triton one
            if not _gluon(cfg):
                raise
            _REFUSED[key] = refusal(e)
            return None

    right, wrong = checked_tiles(candidates, product, reference_outputs(check, codes, scales, zeros, layout, outputs),
                                 outputs)
    if wrong:
        _WRONG.setdefault(key, {}).update(wrong)
    return right


def checked_tiles(tiles, product: Callable, want: torch.Tensor, outputs: torch.Tensor) -> tuple[list, dict]:
    """The ``tiles`` whose ``product(tile)`` equals ``want`` at columns ``outputs`` (:func:`divergence`),
    and each other tile's first divergence, or why it could not be built or run here (a compiler
    that refuses a tile on this board's Triton or GPU costs that tile, not the tuning); a tile whose
    product is None is in neither. A fault of the device itself is raised: nothing after it would
    run. Both tuners check their candidates so before timing them."""
    at, right, wrong = outputs.to(want.device), [], {}
    for tile in tiles:
        try:
            got = product(tile)
        except Exception as exc:  # noqa: BLE001 - any compiler's or launcher's refusal, named in the report
            wrong[tile] = f"could not be built or run here: {refusal(exc)}"
            continue
        if got is None:
            continue
        why = divergence(got[:, at], want, outputs)
        if why is None:
            right.append(tile)
        else:
            wrong[tile] = why
    return right, wrong


# CUDA's sticky errors, as torch ("CUDA error: ...") and Triton ("Triton Error [CUDA]: ...") word them:
# after one the process's context is lost and every later call fails.
STICKY_FAULTS = ("illegal memory access", "misaligned address", "illegal instruction", "unspecified launch failure",
                 "hardware stack error", "device-side assert")


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the device's sticky faults, rather than a tile a compiler or a launch
    refused (a launch asking for too many registers leaves the context as it was)."""
    said = str(exc).lower()
    return any(fault in said for fault in STICKY_FAULTS)


def refusal(exc: BaseException) -> str:
    """Why a tile could not be built or run, in a line: ``exc``'s type and its message's first line.
    A fault of the device itself is raised instead (:func:`device_fault`): nothing after it would run."""
    if device_fault(exc):
        raise exc
    said = str(exc).strip().splitlines()
    return type(exc).__name__ + (f": {said[0][:200]}" if said else "")


def _gluon(cfg: MmConfig | StagedGemvConfig) -> bool:
    """Whether ``cfg`` is a tile of a Gluon kernel (the tensor-core or the staged one)."""
    return isinstance(cfg, StagedGemvConfig) or cfg.mma


def _tile_name(cfg: MmConfig | StagedGemvConfig) -> str:
    if isinstance(cfg, StagedGemvConfig):
        return f"staged {cfg.warps}w/split{cfg.split}"
    kind = "tensor-core" if cfg.mma else "dot"
    return (f"{kind} {cfg.bn}x{cfg.bk}/split{cfg.split}/{cfg.warps}w/{cfg.stages}s" + ("/wa" if cfg.w_a else "")
            + ("/x-shared" if cfg.x_shared else "") + ("/wide" if cfg.wide else "") + ("/staged" if cfg.staged else ""))


STAGED_KERNEL = "staged"  # a tile cache entry's ``kernel`` where it names a tile of the staged kernel


def _cache_fields(cfg: MmConfig | StagedGemvConfig) -> dict:
    """``cfg`` as the tile cache keeps it: its fields, and the staged kernel's name for its tiles."""
    return asdict(cfg) | ({"kernel": STAGED_KERNEL} if isinstance(cfg, StagedGemvConfig) else {})


def _kept_config(fields: dict | None) -> MmConfig | StagedGemvConfig | None:
    """The tile a tile cache's entry names, or None where it names none this code can run."""
    if fields is None:
        return None
    fields = dict(fields)
    tile = StagedGemvConfig if fields.pop("kernel", None) == STAGED_KERNEL else MmConfig
    try:
        return tile(**fields)
    except TypeError:
        return None


def packed_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              layout: PackedGeometry, config: MmConfig | None = None, warmup: bool = False) -> torch.Tensor | None:
    """``x @ W.T`` for ``x`` [M, K] with M ≤ :data:`MAX_DOT_ROWS`, ``W`` the packed [N, K] weight;
    ``config`` None: :func:`tuned_config` (where no tile is right, the dequantized weight).
    ``warmup``: compile the kernel, run nothing, return None
    (:func:`compile_ahead`)."""
    m = x.shape[0]
    if m > MAX_DOT_ROWS:
        raise ValueError(f"packed_mm takes at most {MAX_DOT_ROWS} rows, got {m}: dequantize and use a GEMM")
    x = x.contiguous()
    cfg = config or tuned_config(x, codes, scales, zeros, layout)
    if cfg is None:  # no tile gave torch's outputs here (tuned_config warned)
        return None if warmup else x @ dequantize_with_torch(codes, scales, zeros, layout, x.dtype).t()
    if isinstance(cfg, StagedGemvConfig):
        try:
            return staged.staged_mm(x, PackedParts(codes, scales, zeros, layout), cfg, workspace=_workspace(x.device),
                                    warmup=warmup)
        except staged.CannotTake:  # a weight of the tuned layout this tile cannot copy (codes not 16-byte aligned)
            cfg = mm_config(layout, m, x.device)
    if cfg.mma:
        return tensor_core.mma_mm(x, codes, scales, zeros, layout.n, layout.group_constexpr, bn=cfg.bn, bk=cfg.bk,
                                  split=cfg.split, warps=cfg.warps, workspace=_workspace(x.device),
                                  ahead=cfg.stages - 1, x_shared=cfg.x_shared, wide=cfg.wide, staged=cfg.staged,
                                  warmup=warmup)
    bm = max(16, pow2(m))
    grid = (triton.cdiv(layout.n, cfg.bn), triton.cdiv(m, bm), cfg.split)
    y = torch.empty(m, layout.n, dtype=x.dtype, device=x.device)
    parts, arrivals = _workspace(x.device).take(cfg.split * m * layout.n, grid[0] * grid[1]) \
        if cfg.split > 1 else (y, y)
    launch(_packed_mm_kernel, grid, warmup,
           x, codes, scales, zeros if zeros is not None else scales, y, parts, arrivals, m, layout.n, layout.k,
           layout.groups, x.stride(0), layout.n, cfg.split,
           BM=bm, BN=cfg.bn, BK=cfg.bk, SPLIT_K=cfg.split > 1, BITS=layout.bits, GS=layout.group_constexpr,
           HAS_Z=zeros is not None, IEEE=x.dtype == torch.float32, W_A=cfg.w_a, ASM=not interpreting(),
           num_warps=cfg.warps, num_stages=cfg.stages)
    return None if warmup else y


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, layout: PackedGeometry,
               dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype``."""
    w = torch.empty(layout.n, layout.k, dtype=dtype, device=codes.device)
    bn, bk = 32, _tile_k(layout, 128)
    _dequantize_kernel[(triton.cdiv(layout.n, bn), triton.cdiv(layout.k, bk))](
        codes, scales, zeros if zeros is not None else scales, w, layout.n, layout.k, layout.groups,
        BN=bn, BK=bk, BITS=layout.bits, GS=layout.group_constexpr, HAS_Z=zeros is not None, ASM=not interpreting(),
        num_warps=4)
    return w


def tuned_choices() -> list[dict]:
    """The tiles :func:`tuned_config` chose in this process, for benchmark reports: each one's kernel
    (``torch`` where no tile was right), and the tiles refused for their outputs (``wrong_outputs``)."""
    choices = []
    for key, cfg in _TUNED.items():
        layout, bm, has_z, dtype, _ = key
        choice = {"n": layout.n, "k": layout.k, "bits": layout.bits, "row_tile": bm, "zeros": has_z,
                  "dtype": str(dtype), "source": "cache" if key in _FROM_CACHE else "timed"}
        if cfg is None:
            choice["kernel"] = "torch"
        elif isinstance(cfg, StagedGemvConfig):
            choice.update(warps=cfg.warps, split=cfg.split, kernel=STAGED_KERNEL)
        else:
            choice.update(bn=cfg.bn, bk=cfg.bk, split=cfg.split, weight_first=cfg.w_a, x_shared=cfg.x_shared,
                          wide=cfg.wide, staged=cfg.staged, kernel="tensor_core" if cfg.mma else "dot")
        if key in _REFUSED:
            choice["tensor_core_refused"] = _REFUSED[key]
        if key in _WRONG:
            choice["wrong_outputs"] = {_tile_name(c): why for c, why in _WRONG[key].items()}
        choices.append(choice)
    return choices
