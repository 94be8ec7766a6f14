"""A decode step over the paged pool: at batch 1 in five Triton kernels per layer.

At batch 1 a decode step reads every weight once and does almost no arithmetic, so it
runs as fast as its matrix-vector products stream memory and as slowly as the small
kernels between them. A compiled layer launches some twenty kernels around its four
cuBLAS products (norms, RoPE, the past's gather and concatenation, the mask, attention);
on an H200 they took as long as the products. Here a layer is:

1. RMSNorm fused into the q|k|v product (plus its bias);
2. attention over the paged pool (:func:`~.decode_attention.paged_attention`): RoPE on the
   fly, the past read where it lies, the splits of the context merged by the last to finish, so
   no second kernel comes between the attention and the o product;
3. the o product plus the residual;
4. RMSNorm fused into the gate|up product, and SiLU(gate)·up into its epilogue (a program
   takes gate row j with up row j, so it writes the activation, half as wide);
5. the down product plus the residual.

Every product reads its weight ``[out, in]`` row-major, a tile of whole rows per program,
and keeps the rounding points of the eager layer (bf16 after each product, norm and
product-sum), so it gives the eager layer's tokens within the dtype's tolerance. The
tile sizes are chosen at load by timing candidates on the device: each product alone, then
in whole steps (:mod:`.step_tuning`), where a tile's overlap with the kernel before it shows.

Packed 4-bit and 8-bit weights (:class:`~edgeinfer.quant.packed.PackedMatrix`) take
:func:`packed_gemv`, with the same prologues and epilogues: a tile of x is read once, contiguous,
and its columns taken apart in registers to meet each value of the packed words, and a group's
words are summed before its scale is applied; long rows are split along K, and the last split
of a tile to finish adds the partial sums in a fixed order and writes the row, so a product
stays one kernel and gives the same bits on every run.

Each kernel reads its weights a step ahead of its arithmetic. On Hopper and later the kernels
launch as programmatic dependents (:func:`~edgeinfer.quant.launching.dependent_launch`): one
starts while the kernel before it finishes, reads its first step's weights, and only then waits
for its inputs (:func:`~edgeinfer.quant.kernels.await_inputs`).

At 2 to 16 rows the layers run the same way on the staged tensor-core products
(:func:`~edgeinfer.quant.staged.staged_mm`, the norms and epilogues fused alike) where the
few-row tuner chose them for all four products (:meth:`FusedDecode.row_tiles`); otherwise, and
at more rows, the attention kernel runs between the layer's own products (``qkv`` and
``after_attention``, compiled by the caller).

Triton is optional: on a machine without it (CPUs, most Jetson wheels) the compiled or
eager layers run instead.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

from edgeinfer.backends.torch.decode_attention import paged_attention
from edgeinfer.backends.torch.step_ends import StepEnds
from edgeinfer.backends.torch.step_tuning import (
    STEP_CANDIDATES,
    STEP_TUNING_BLOCK,
    STEP_TUNING_CONTEXT,
    descend,
    step_time_us,
)
from edgeinfer.models.decoder import DecoderLayer
from edgeinfer.progress import NoSteps, Steps
from edgeinfer.quant import staged
from edgeinfer.quant.kernels import (
    cannot_build,
    checked_outputs,
    checked_tiles,
    compile_ahead,
    dequantized_rows,
    graph_time_us,
    row_tile,
    tuned_config,
)
from edgeinfer.quant.launching import (
    SplitWorkspace,
    fused_rows_enabled,
    integer_dot_enabled,
    rows_in_step_enabled,
    step_ends_enabled,
    interpreting,
    launch,
    launch_options,
    pow2,
)
from edgeinfer.quant.packed import PackedMatrix
from edgeinfer.quant.staged import StagedGemvConfig, staged_gemv, staged_mm
from edgeinfer.tile_cache import TileCache, device_identity

# The tile cache's kinds for the batch-1 step's tiles and for the few-row layers' tiles by row tile.
FUSED_TILES = "fused-step"
FUSED_ROW_TILES = "fused-rows"
# The phases :meth:`FusedDecode.tune` reports its timings under.
TILES_ALONE = "timing each product's tiles"
TILES_IN_STEP = "timing tiles in the whole step"

try:  # the import decides whether this path exists at all
    import triton
    import triton.language as tl

    from edgeinfer.quant.kernels import (
        await_inputs,
        biased_codes_at,
        as_int16,
        code_exponent,
        dp2a,
        group_params,
        load_where,
        params_from,
        prmt,
        split_total,
    )
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = None


def available(device: torch.device) -> str | None:
    """None when the fused step can run on ``device``, else the reason it cannot."""
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return "not a CUDA device"
    reason = cannot_build(device)
    return f"Triton {triton.__version__} cannot build for this GPU ({reason})" if reason else None


# The rows the batch-1 Triton products serve: they stream each weight once per row and beat
# cuBLAS at one row; at more rows tensor-core tiles win, so larger batches take the staged
# products (:meth:`FusedDecode.row_tiles`) or the layer's own.
MAX_GEMV_ROWS = 1

NONE, RMSNORM = 0, 1  # what a product does to its input first

if triton is not None:

    @triton.jit
    def _input_values(X, NORM_W, rk, K, rstd, PROLOGUE: tl.constexpr, dt: tl.constexpr, EVEN: tl.constexpr = False,
                      OK=None):
        """f(X)[rk] in ``dt`` for column indices ``rk`` of any shape (``X`` a row, or rows broadcast
        against ``rk``; ``rstd`` 1 / rms of those rows), rounded as the eager layer rounds: RMSNorm
        first with ``PROLOGUE`` 1. ``EVEN``: every ``rk`` is below K (no bounds checks); else ``OK``, where given,
        says which are (a word's columns all are or none: one compare for its values, not one each)."""
        ok = rk < K
        if OK is not None:
            ok = OK
        xv = load_where(X + rk, ok, EVEN)
        if PROLOGUE == 1:
            nw = load_where(NORM_W + rk, ok, EVEN).to(tl.float32)
            xn = (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)
            xv = (xn * nw).to(dt)
        return xv

    @triton.jit
    def _input_tile(X, NORM_W, rm, rk, stride_x, K, rstd, PROLOGUE: tl.constexpr, dt: tl.constexpr):
        """f(X)[rm, rk] in ``dt``: :func:`_input_values` of rows ``rm``."""
        return _input_values(X + rm[:, None] * stride_x, NORM_W, rk[None, :], K, rstd[:, None], PROLOGUE, dt)

    @triton.jit
    def _epilogue(acc, bias, res, out, ok, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
        """``out`` = acc (+ bias) (+ residual) at the pointers given, rounded to the output's dtype
        after each step as the eager layer rounds."""
        dt = out.dtype.element_ty
        y = acc.to(dt)
        if HAS_BIAS:
            y = (y.to(tl.float32) + tl.load(bias, mask=ok, other=0.0).to(tl.float32)).to(dt)
        if HAS_RES:
            y = (y.to(tl.float32) + tl.load(res, mask=ok, other=0.0).to(tl.float32)).to(dt)
        tl.store(out, y, mask=ok)

    @triton.jit
    def _glu_epilogue(acc, bias, rows_ok, out, ok, BH: tl.constexpr, HAS_BIAS: tl.constexpr):
        """``out`` = SiLU(gate)·up for ``acc`` [M, 2·BH] whose first BH columns are gate rows and
        the last BH the up rows of the same outputs (``bias`` and ``rows_ok`` theirs; ``out`` and
        ``ok`` [M, BH]), rounded as the eager layer rounds: the product (plus bias), SiLU, then
        the product of the two."""
        dt = out.dtype.element_ty
        y = acc.to(dt)
        if HAS_BIAS:
            y = (y.to(tl.float32) + tl.load(bias, mask=rows_ok, other=0.0).to(tl.float32)).to(dt)
        pair = tl.reshape(y.to(tl.float32), [acc.shape[0], 2, BH])
        half = tl.arange(0, 2)[None, :, None]
        g = tl.sum(tl.where(half == 0, pair, 0.0), axis=1)
        u = tl.sum(tl.where(half == 1, pair, 0.0), axis=1)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(out, (act * u).to(dt), mask=ok)

    @triton.jit
    def _write_row(acc, BIAS, RES, Y, rn, n_ok, tile, N, BN: tl.constexpr, GLU: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
        """A program's sums ``acc`` [M, BN] of rows ``rn`` (:func:`_tile_rows`) finished and stored:
        :func:`_epilogue` at columns ``rn`` of ``Y``, or with ``GLU`` :func:`_glu_epilogue` at
        the BN // 2 outputs of ``tile``; ``RES`` and ``Y`` point at each of the M rows' start."""
        if GLU:
            BH: tl.constexpr = BN // 2
            j = tile * BH + tl.arange(0, BH)
            _glu_epilogue(acc, BIAS + rn[None, :], n_ok[None, :], Y + j[None, :], (j < N // 2)[None, :], BH,
                          HAS_BIAS)
        else:
            _epilogue(acc, BIAS + rn[None, :], RES + rn[None, :], Y + rn[None, :], n_ok[None, :], HAS_BIAS, HAS_RES)

    @triton.jit
    def _tile_rows(tile, N, BN: tl.constexpr, GLU: tl.constexpr):
        """A program's BN weight rows and which are real: ``tile``'s BN rows; with ``GLU`` (rows
        gate | up, N // 2 each) BN // 2 gate rows and the up rows of the same outputs."""
        r = tl.arange(0, BN)
        if GLU:
            BH: tl.constexpr = BN // 2
            j = tile * BH + r % BH
            return j + (r // BH) * (N // 2), j < N // 2
        rn = tile * BN + r
        return rn, rn < N

    @triton.jit
    def _gemv_kernel(X, W, BIAS, RES, NORM_W, Y, N, K, stride_x, stride_r, stride_y, eps,
                     MP: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
                     XB: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr):
        """Y[m, n] = sum_k f(X)[m, k] * W[n, k] (+ bias) (+ residual) for a tile of BN outputs of a
        dense W; with ``GLU`` (:func:`_tile_rows`) SiLU(gate)·up of BN // 2 outputs instead. A
        step's weights are read while the step before it multiplies, the first step's before the
        kernels before this one have finished (``PDL``, :func:`await_inputs`)."""
        dt = Y.dtype.element_ty
        pid = tl.program_id(0)
        rn, n_ok = _tile_rows(pid, N, BN, GLU)
        rm = tl.arange(0, MP)
        rows = rn.to(tl.int64) * K
        rk = tl.arange(0, BK)
        w = tl.load(W + rows[:, None] + rk[None, :], mask=n_ok[:, None] & (rk[None, :] < K), other=0.0)
        await_inputs(PDL)
        rstd = tl.zeros([MP], tl.float32)
        if PROLOGUE == 1:  # RMSNorm over each row of X, XB columns a wait
            ss = tl.zeros([MP], tl.float32)
            for k0 in range(0, K, XB):
                rx = k0 + tl.arange(0, XB)
                xv = tl.load(X + rm[:, None] * stride_x + rx[None, :], mask=rx[None, :] < K, other=0.0)
                xv = xv.to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([MP, BN], tl.float32)
        wide = tl.zeros([BN, BK], tl.float32)  # one row: products summed across K only at the end
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            xv = _input_tile(X, NORM_W, rm, rk, stride_x, K, rstd, PROLOGUE, dt)
            this_w = w
            rk_next = rk + BK  # the next step's weights (none past the row)
            w = tl.load(W + rows[:, None] + rk_next[None, :], mask=n_ok[:, None] & (rk_next[None, :] < K), other=0.0)
            if USE_DOT:
                if IEEE:
                    acc += tl.dot(xv, tl.trans(this_w), input_precision="ieee")
                else:
                    acc += tl.dot(xv, tl.trans(this_w))
            elif MP == 1:
                wide += this_w.to(tl.float32) * xv.to(tl.float32)
            else:
                acc += tl.sum(xv.to(tl.float32)[:, None, :] * this_w.to(tl.float32)[None, :, :], axis=2)
        if MP == 1 and not USE_DOT:
            acc = tl.sum(wide, axis=1)[None, :]
        _write_row(acc, BIAS, RES + rm[:, None] * stride_r, Y + rm[:, None] * stride_y, rn, n_ok, pid, N, BN, GLU,
                   HAS_BIAS, HAS_RES)


    @triton.jit
    def _step_params(S, Z, S_ROWS, Z_ROWS, rn, k0, N, G, BK: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                     HAS_Z: tl.constexpr, EVEN: tl.constexpr, POW2_GROUPS: tl.constexpr):
        """The scales and zero points a K step from ``k0`` reads: with ``POW2_GROUPS`` one a group, from
        ``S_ROWS`` / ``Z_ROWS`` (each row's first groups' addresses, [BN, groups a step]) moved by the
        step's first group; else one a word (:func:`group_params`). Moving the addresses by one number
        the step's threads share lets the loads take it as an offset: the addresses are not
        computed again each step."""
        if POW2_GROUPS:
            NG: tl.constexpr = BK // GS if BK >= GS else 1
            g = k0 // GS
            ok = (rn[:, None] < N) & ((g + tl.arange(0, NG))[None, :] < G)
            s, z = params_from(S_ROWS + g, Z_ROWS + g, ok, BITS, HAS_Z, EVEN)
        else:
            s, z = group_params(S, Z, rn, k0, N, G, BK, BITS, GS, HAS_Z, EVEN)
        return s, z

    @triton.jit
    def _integer_dot(words, X, NORM_W, first, inside, K, rstd, PROLOGUE: tl.constexpr, dt: tl.constexpr,
                     EVEN: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
        """For 4-bit and 8-bit words [BN, words] whose values start at x's columns ``first`` [words] (those
        ``inside`` the row, [words], read; the others' x is zero): each
        word's ``1.5·2^23 + Σ q_i·r_i`` as a float32 (exact), with q_i its unsigned codes and r_i its
        columns of x (:func:`_input_values`) as integers at the word's own scale, ``x_i ≈ scale·r_i``;
        and each word's scale and ``Σ r_i`` [words].

        x's columns of a word take the largest of them to 32,767 (4-bit) or 4,095 (8-bit), so a word's dot
        stays below 2^22 and exact; and the x of every row of the tile is scaled once. A 4-bit word's
        codes then cost a mask, a shift and a mask (its even and its odd nibbles as four bytes each) and
        four ``dp2a`` (:func:`dp2a`: two 16-bit integers of x by two bytes, added into a 32-bit
        integer), an 8-bit word's two ``dp2a``; the sum starts at 1.5·2^23's bits, so it is a float
        without a conversion."""
        XQ: tl.constexpr = 32767 if BITS == 4 else 4095
        x0 = _input_values(X, NORM_W, first, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
        x1 = _input_values(X, NORM_W, first + 1, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
        x2 = _input_values(X, NORM_W, first + 2, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
        x3 = _input_values(X, NORM_W, first + 3, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
        m = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
        if BITS == 4:
            x4 = _input_values(X, NORM_W, first + 4, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
            x5 = _input_values(X, NORM_W, first + 5, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
            x6 = _input_values(X, NORM_W, first + 6, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
            x7 = _input_values(X, NORM_W, first + 7, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
            m = tl.maximum(m, tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
        m = tl.maximum(m, 7.888609052210118e-31)  # 2^-100: all zeros take a finite scale
        inv = XQ / m
        b0, r0 = as_int16(x0, inv)
        b1, r1 = as_int16(x1, inv)
        b2, r2 = as_int16(x2, inv)
        b3, r3 = as_int16(x3, inv)
        dot = tl.full(words.shape, 0x4B400000, tl.int32)  # 1.5·2^23's bits
        if BITS == 4:  # bytes of the even nibbles: values 0, 2, 4, 6; of the odd: 1, 3, 5, 7
            b4, r4 = as_int16(x4, inv)
            b5, r5 = as_int16(x5, inv)
            b6, r6 = as_int16(x6, inv)
            b7, r7 = as_int16(x7, inv)
            even = words & 0x0F0F0F0F
            odd = (words >> 4) & 0x0F0F0F0F
            dot = dp2a(tl.broadcast_to(prmt(b0, b2, 0x5410, ASM)[None, :], words.shape), even, dot, False, ASM)
            dot = dp2a(tl.broadcast_to(prmt(b4, b6, 0x5410, ASM)[None, :], words.shape), even, dot, True, ASM)
            dot = dp2a(tl.broadcast_to(prmt(b1, b3, 0x5410, ASM)[None, :], words.shape), odd, dot, False, ASM)
            dot = dp2a(tl.broadcast_to(prmt(b5, b7, 0x5410, ASM)[None, :], words.shape), odd, dot, True, ASM)
            xints = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        else:  # bytes 0-3: values 0-3
            dot = dp2a(tl.broadcast_to(prmt(b0, b1, 0x5410, ASM)[None, :], words.shape), words, dot, False, ASM)
            dot = dp2a(tl.broadcast_to(prmt(b2, b3, 0x5410, ASM)[None, :], words.shape), words, dot, True, ASM)
            xints = (r0 + r1) + (r2 + r3)
        return dot.to(tl.float32, bitcast=True), m / XQ, xints

    @triton.jit
    def _packed_gemv_kernel(X, W, S, Z, BIAS, RES, NORM_W, Y, PARTS, ARRIVALS, N, K, G, per_split, splits, eps,
                            PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                            HAS_Z: tl.constexpr, SPLIT_K: tl.constexpr, EXACT: tl.constexpr, EVEN: tl.constexpr,
                            ONE_GROUP: tl.constexpr, POW2_GROUPS: tl.constexpr, XB: tl.constexpr,
                            GLU: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, WIDE: tl.constexpr = False,
                            IDOT: tl.constexpr = False):
        """Y[n] = sum_k f(X)[k] * W[n, k] (+ bias) (+ residual) for one row and a packed low-bit W,
        over columns [split · per_split, (split + 1) · per_split) of BN outputs.

        A decode product reads too few bytes to stream at the memory's rate: it is held back by
        the loads it has in flight and its programs' chains of waits (a tensor-core kernel that
        issued a third of these instructions a word was no faster, docs/gpu-kernels.md). Still,
        a weight costs only a shift, an and-or and a multiply-add (an 8-bit one with bf16 activations,
        ``WIDE``, a byte permute and a multiply-add): each word's ``sum_i (2^b + q_i)·x_i``
        is taken with the codes biased (:func:`biased_codes_at`; with ``EXACT``, the activations'
        16-bit floats, those products are exact), and per word, not per weight, the bias, the
        zero point and the scale are applied: ``s·(dot - (2^b + z)·sum_i x_i)``. A step takes x's
        sums first, so a word's multiply-adds start from ``-(2^b + z)·sum_i x_i`` rather than zero,
        and the word then costs one more multiply-add for its scale (the second pass over x's
        columns reads what the first read: the compiler loads them once). With
        ``ONE_GROUP`` (a scale a row) even that waits for the last K step; with ``POW2_GROUPS``
        (groups of a power of two columns) a step reads one scale a group and applies it to the
        group's words, not one a word, which saves each thread a load and its address per word.
        Words are summed across threads once, after the last K step; ``EVEN`` (whole tiles) reads
        without bounds checks. With ``SPLIT_K`` each program writes its partial sums to ``PARTS`` and counts
        itself in ``ARRIVALS``; the last of a tile's splits to arrive adds the partials in split
        order (the same sum whichever arrives last), finishes the row and sets the count back to
        zero. With ``GLU`` a tile is BN // 2 outputs' gate and up rows (:func:`_tile_rows`) and
        writes SiLU(gate)·up. A step's words and scales are read while the step before it
        multiplies, the first step's before the kernels before this one have finished (``PDL``,
        :func:`await_inputs`). With ``IDOT`` (16-bit activations) a word's codes meet x's columns as 16-bit
        integers instead, by ``dp2a`` (:func:`_integer_dot`): about a third fewer instructions a word."""
        PER: tl.constexpr = 32 // BITS
        dt = Y.dtype.element_ty
        tile = tl.program_id(0)
        split = tl.program_id(1)
        rn, n_ok = _tile_rows(tile, N, BN, GLU)
        BKW: tl.constexpr = BK // PER  # words a row per K step
        start = split * per_split
        end = tl.minimum(start + per_split, K)
        rw = start // PER + tl.arange(0, BKW)
        # one word a thread (per row): the tile's words then lie across threads as x's columns do, and
        # no step moves x or the sums between layouts through shared memory
        words_at = W + rn[:, None].to(tl.int64) * tl.multiple_of(K // PER, 1) + rw[None, :]
        words = load_where(words_at, n_ok[:, None] & (rw[None, :] < K // PER), EVEN)
        NG: tl.constexpr = BK // GS if BK >= GS else 1  # groups a step meets (POW2_GROUPS)
        if POW2_GROUPS:  # the first step's groups' addresses, moved a step at a time
            S_ROWS = S + rn[:, None] * G + tl.arange(0, NG)[None, :]
            Z_ROWS = Z + rn[:, None] * G + tl.arange(0, NG)[None, :]
        else:  # other groups take their addresses a word at a time
            S_ROWS, Z_ROWS = S, Z
        if not ONE_GROUP:
            s, z = _step_params(S, Z, S_ROWS, Z_ROWS, rn, start, N, G, BK, BITS, GS, HAS_Z, EVEN, POW2_GROUPS)
        await_inputs(PDL)
        rstd = 1.0
        if PROLOGUE == 1:  # RMSNorm over the whole row, whatever columns this program reads
            ss = tl.zeros([XB], tl.float32)
            for k0 in range(0, K, XB):  # once for rows up to XB: one wait for x, not one a step
                rk = k0 + tl.arange(0, XB)
                xv = tl.load(X + rk, mask=rk < K, other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
        wide = tl.zeros([BN, BKW], tl.float32)  # a sum per word of the tile, added across words at the end
        # 2^15's bits for WIDE's byte permutes, in one register: ``| (N >> 31)`` (0: N is never negative)
        # keeps the compiler from seeing a constant, which ptxas then moved into a register before
        # nearly every permute (62 more instructions a step)
        exponent = 0
        if WIDE:
            exponent = tl.full([BN, BKW], 0, tl.int32) + (((127 + 15) << 23) | (N >> 31))
        xsums = tl.zeros([BKW], tl.float32)  # one group a row: x's sums, taken off once at the end
        xbiases = tl.zeros([BKW], tl.float32)
        stepped = 0  # words the step's words lie past the first step's (one number: the loads' offset)
        for k0 in range(start, end, BK):
            first = rw * PER  # each word's first column
            inside = first < K  # a word's columns are all in the row or none (a row is a whole number of words)
            this_words = words
            if not ONE_GROUP:
                this_s, this_z = s, z
            # the next step's words and scales (the last step reads its own again, not past its columns)
            ahead = tl.where(k0 + BK < end, BK, 0)
            stepped += ahead // PER
            rw += ahead // PER
            words = load_where(words_at + stepped, n_ok[:, None] & (rw[None, :] < K // PER), EVEN)
            if not ONE_GROUP:
                s, z = _step_params(S, Z, S_ROWS, Z_ROWS, rn, k0 + ahead, N, G, BK, BITS, GS, HAS_Z, EVEN,
                                    POW2_GROUPS)
            if IDOT:  # each word's integer dot: x·(q - z) = scale·(dot - 1.5·2^23 - z·Σr), per word
                val, xscale, xints = _integer_dot(this_words, X, NORM_W, first, inside, K, rstd, PROLOGUE, dt,
                                                  EVEN, BITS, ASM)
                xmagic = xscale * 12582912.0
                xsum = xscale * xints
                if ONE_GROUP:  # the zero point waits for the last step
                    dot = wide + (val * xscale[None, :] - xmagic[None, :])
                    xsums += xsum
                elif POW2_GROUPS:  # [rows, groups, words a group]: a group's zero point meets its words
                    dot = val * xscale[None, :] - tl.reshape(
                        tl.reshape(xmagic, [NG, BKW // NG])[None, :, :]
                        + this_z[:, :, None] * tl.reshape(xsum, [NG, BKW // NG])[None, :, :], [BN, BKW])
                else:
                    dot = val * xscale[None, :] - (xmagic[None, :] + this_z * xsum[None, :])
            else:
                xsum = tl.zeros([BKW], tl.float32)
                xbias = tl.zeros([BKW], tl.float32)  # sum_i 2^e_i·x_i: what the biased codes add
                for i in tl.static_range(PER):  # x's sums first: a word's sum then starts at what they take off
                    xi = _input_values(X, NORM_W, first + i, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
                    if EXACT:
                        xbias += xi * (1 << code_exponent(i, BITS, WIDE))  # biased_codes_at's 2^e
                    xsum += xi
                if ONE_GROUP:  # one scale a row: words summed across steps as they are, corrected at the end
                    dot = wide
                    xsums += xsum
                    xbiases += xbias
                elif POW2_GROUPS:  # [rows, groups, words a group]: a group's zero point meets its words
                    xbias3 = tl.reshape(xbias, [NG, BKW // NG])[None, :, :]
                    xsum3 = tl.reshape(xsum, [NG, BKW // NG])[None, :, :]
                    dot = tl.reshape(-(xbias3 + this_z[:, :, None] * xsum3), [BN, BKW])
                else:
                    dot = -(xbias[None, :] + this_z * xsum[None, :])
                for i in tl.static_range(PER):  # value i of every word meets column first + i of x
                    xi = _input_values(X, NORM_W, first + i, K, rstd, PROLOGUE, dt, EVEN, inside).to(tl.float32)
                    if EXACT:
                        dot += biased_codes_at(this_words, i, BITS, ASM, WIDE, exponent) * xi[None, :]
                    else:  # float32 activations: the bias off each value before the product
                        bias = 1 << code_exponent(i, BITS, WIDE)
                        dot += (biased_codes_at(this_words, i, BITS, ASM, WIDE, exponent) - bias) * xi[None, :]
            if ONE_GROUP:  # the scale and zero point wait for the last step
                wide = dot
            elif POW2_GROUPS:  # a group's scale meets its words' sums
                wide += tl.reshape(this_s[:, :, None] * tl.reshape(dot, [BN, NG, BKW // NG]), [BN, BKW])
            else:
                wide += this_s * dot
        if ONE_GROUP:
            s, z = group_params(S, Z, rn, 0, N, G, PER, BITS, GS, HAS_Z, EVEN)  # [BN, 1]: the row's group
            s, z = tl.sum(s, axis=1), tl.sum(z, axis=1)
            acc = s * (tl.sum(wide, axis=1) - tl.sum(xbiases, axis=0) - z * tl.sum(xsums, axis=0))
        else:
            acc = tl.sum(wide, axis=1)
        if SPLIT_K:
            last, total = split_total(acc, PARTS, ARRIVALS, rn, n_ok, tile, split, splits, N)
            if last:
                _write_row(total[None, :], BIAS, RES, Y, rn, n_ok, tile, N, BN, GLU, HAS_BIAS, HAS_RES)
        else:
            _write_row(acc[None, :], BIAS, RES, Y, rn, n_ok, tile, N, BN, GLU, HAS_BIAS, HAS_RES)


@dataclass(frozen=True)
class GemvConfig:
    bn: int
    bk: int
    warps: int
    stages: int


# Candidates timed per product at load (``FusedDecode.tune``): long K tiles for wide rows,
# narrow N tiles where there are few outputs (more programs in flight).
GEMV_CANDIDATES = (GemvConfig(2, 512, 2, 3), GemvConfig(4, 256, 2, 3), GemvConfig(4, 512, 4, 3),
                   GemvConfig(8, 256, 4, 3), GemvConfig(8, 512, 4, 2), GemvConfig(16, 128, 4, 3),
                   GemvConfig(16, 256, 8, 2), GemvConfig(32, 128, 8, 2), GemvConfig(4, 1024, 8, 2),
                   GemvConfig(8, 128, 2, 4), GemvConfig(16, 512, 8, 3), GemvConfig(8, 1024, 8, 2),
                   GemvConfig(2, 1024, 4, 2))


def _norm_block(k: int, rows: int, prologue: int) -> int:
    """Columns of x a product's RMSNorm prologue reads at once: a whole row up to 4,096 values
    (a 1,536-wide row in one read, not one a K step); 16 (unused) without the prologue."""
    return min(pow2(k), max(16, 4096 // pow2(rows))) if prologue == RMSNORM else 16


def _outputs(n: int, glu: bool, residual: torch.Tensor | None) -> int:
    """Outputs of a product of N weight rows: N, or N / 2 with ``glu`` (rows gate | up)."""
    if glu and (n % 2 or residual is not None):
        raise ValueError(f"glu needs gate | up rows (an even count, got {n}) and no residual")
    return n // 2 if glu else n


def gemv(x: torch.Tensor, w: torch.Tensor, *, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         glu: bool = False, config: GemvConfig | None = None, out: torch.Tensor | None = None,
         warmup: bool = False) -> torch.Tensor | None:
    """``f(x) @ w.T (+ bias) (+ residual)`` for ``x`` [M, K] and a dense ``w`` [N, K] (a packed
    one: :func:`packed_gemv`); with ``glu`` (``w``'s rows gate | up, N / 2 each) SiLU(gate)·up
    of that product, [M, N / 2]. ``warmup``: compile the kernel, run nothing, return None
    (:func:`~edgeinfer.quant.kernels.compile_ahead`).

    ``f`` is RMSNorm with ``norm_weight``; M is padded to a power of two inside the kernel's
    tile (rows past M compute nothing anyone reads).
    """
    if isinstance(w, PackedMatrix):
        raise TypeError("gemv multiplies dense weights; a packed one goes through packed_gemv")
    m = x.shape[0]
    n, k = w.shape
    outputs = _outputs(n, glu, residual)
    mp = pow2(m)
    cfg = config or GEMV_CANDIDATES[0]
    use_dot = mp >= 16 and cfg.bn >= 16
    bk = cfg.bk if use_dot or mp == 1 else max(32, min(cfg.bk, 4096 // (mp * cfg.bn)))
    if x.shape[0] != mp:  # rows the kernel reads must exist
        x = torch.nn.functional.pad(x, (0, 0, 0, mp - m))
        residual = None if residual is None else torch.nn.functional.pad(residual, (0, 0, 0, mp - m))
    y = out if out is not None else torch.empty(mp, outputs, dtype=x.dtype, device=x.device)
    prologue = RMSNORM if norm_weight is not None else NONE
    launch(_gemv_kernel, (triton.cdiv(outputs, cfg.bn // 2 if glu else cfg.bn),), warmup,
           x, w, bias if bias is not None else w, residual if residual is not None else w,
           norm_weight if norm_weight is not None else w, y, n, k, x.stride(0),
           residual.stride(0) if residual is not None else 0, y.stride(0), eps,
           MP=mp, PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
           BN=cfg.bn, BK=bk, USE_DOT=use_dot, IEEE=x.dtype == torch.float32, XB=_norm_block(k, mp, prologue),
           GLU=glu, **launch_options(x.device), num_warps=cfg.warps, num_stages=cfg.stages)
    return None if warmup else y[:m]


@dataclass(frozen=True)
class PackedGemvConfig:
    """A packed product's tile: ``bn`` outputs by ``bk`` columns a step, K split ``split`` ways."""

    bn: int
    bk: int
    warps: int
    split: int = 1
    registers: int | None = None  # a cap on registers a thread (``maxnreg``): more programs resident
    idot: bool = False  # x's columns as 16-bit integers, dotted with the codes by ``dp2a`` (:func:`_integer_dot`)


# Candidates timed per packed product at load: tiles of 4 to 32 rows by 256 to 2048 columns (a
# thread then holds one word of each of several rows, and x's work is shared by those rows; 2048
# columns read a 1,536-wide row in one step), K split four or eight ways for ``down``-like
# products (few outputs, long rows: too few programs unsplit).
PACKED_GEMV_CANDIDATES = (
    PackedGemvConfig(16, 1024, 4), PackedGemvConfig(16, 512, 4), PackedGemvConfig(8, 1024, 4),
    PackedGemvConfig(32, 512, 4), PackedGemvConfig(32, 256, 4), PackedGemvConfig(16, 256, 4),
    PackedGemvConfig(32, 512, 8), PackedGemvConfig(32, 1024, 8), PackedGemvConfig(16, 512, 2),
    PackedGemvConfig(8, 512, 2), PackedGemvConfig(16, 2048, 4), PackedGemvConfig(8, 2048, 4),
    PackedGemvConfig(4, 2048, 2), PackedGemvConfig(8, 1024, 4, 4), PackedGemvConfig(16, 512, 4, 4),
    PackedGemvConfig(8, 512, 4, 4), PackedGemvConfig(16, 256, 4, 4), PackedGemvConfig(8, 1024, 4, 8),
    PackedGemvConfig(16, 1024, 4, 8), PackedGemvConfig(8, 2048, 4, 4),
    # 16-row tiles held to 96 registers a thread: ten (or five) programs an SM rather than eight (four)
    PackedGemvConfig(16, 512, 2, 1, 96), PackedGemvConfig(16, 1024, 4, 8, 96),
)


# Tiles with x's columns as 16-bit integers dotted with the codes by ``dp2a`` (:func:`_integer_dot`): about a
# third fewer instructions a word in ptxas's K step for sm_90. The ten that were fastest for some 4-bit product
# of Qwen2-VL-2B on an H100 (scripts/probe_integer_dot.py, docs/gpu-kernels.md), timed beside the float ones for
# every packed weight, 4-bit or 8-bit, under 16-bit activations. 8-bit weights with groups of 128 gained too: the
# step took them for q|k|v, and W8A16 decode on an H100 ran 1.022× faster with them among the candidates.
INTEGER_DOT_CANDIDATES = tuple(PackedGemvConfig(*t, idot=True) for t in (
    (16, 2048, 4), (8, 2048, 4), (8, 2048, 4, 4), (4, 2048, 2), (32, 256, 4), (32, 512, 4), (16, 512, 2),
    (16, 512, 2, 1, 96), (16, 1024, 4, 8), (8, 1024, 4, 4)))
# 8-bit weights' two fastest integer-dot tiles for gate|up on an H100 (15.08 and 15.17 µs against 15.75 on the
# fastest float tile, docs/results/probes/h100-integer-dot), which no 4-bit product was fastest on. The step kept
# the first for gate|up, and W8A16 decode on an H100 ran 1.007× faster (docs/results/probes/h100-w8-gate-up-tiles).
INTEGER_DOT_8BIT_CANDIDATES = (PackedGemvConfig(16, 256, 4, idot=True), PackedGemvConfig(8, 512, 2, idot=True))
# The integer-dot tiles timed for a packed weight, by its code width
_INTEGER_DOT_TILES = {4: INTEGER_DOT_CANDIDATES, 8: INTEGER_DOT_CANDIDATES + INTEGER_DOT_8BIT_CANDIDATES}

Tile = GemvConfig | PackedGemvConfig | StagedGemvConfig
_TILE_CLASSES = {"dense": GemvConfig, "packed": PackedGemvConfig, "staged": StagedGemvConfig}  # a kept tile's kind
_TILE_KINDS = {cls: kind for kind, cls in _TILE_CLASSES.items()}


def _candidates(w: torch.Tensor | PackedMatrix, dtype: torch.dtype | None = None, glu: bool = False) -> tuple[Tile, ...]:
    """The tiles timed for a product of weight ``w`` at batch 1 (``dtype``: the activations'; ``glu``:
    it writes SiLU(gate)·up): a packed product's first is ``packed_gemv``'s, then its integer-dot tiles for its
    code width where the activations are 16-bit, and the staged kernel's where it is enabled and fits
    (:func:`staged.candidates`)."""
    if not isinstance(w, PackedMatrix):
        return GEMV_CANDIDATES
    integer = _INTEGER_DOT_TILES[w.bits] if dtype in (torch.bfloat16, torch.float16) and integer_dot_enabled() else ()
    return PACKED_GEMV_CANDIDATES + integer + tuple(staged.candidates(w, dtype, glu) if dtype is not None else ())


def packed_gemv(x: torch.Tensor, w: PackedMatrix, config: PackedGemvConfig, *, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                glu: bool = False, out: torch.Tensor | None = None,
                workspace: SplitWorkspace | None = None, warmup: bool = False) -> torch.Tensor | None:
    """``f(x) @ W.T (+ bias) (+ residual)`` for one row ``x`` [1, K] and a packed ``W``; ``f``,
    ``glu`` and ``warmup`` as in :func:`gemv`. A split product needs a ``workspace`` (a fresh one
    is made per call otherwise)."""
    if x.shape[0] != 1:
        raise ValueError(f"packed_gemv reads one row, got {x.shape[0]}: use edgeinfer.quant.kernels.packed_mm")
    layout = w.layout
    if config.idot and x.dtype == torch.float32:
        raise ValueError("an integer-dot tile takes 16-bit activations: float32 ones go through its float tile")
    n, k = w.shape
    bk = max(4 * 32 // layout.bits, min(config.bk, pow2(k)))  # four words a row at least
    steps = triton.cdiv(k, bk)
    per_split = triton.cdiv(steps, config.split) * bk
    splits = triton.cdiv(k, per_split)
    outputs = _outputs(n, glu, residual)
    rows = config.bn // 2 if glu else config.bn  # outputs a tile
    tiles = triton.cdiv(outputs, rows)
    y = out if out is not None else torch.empty(1, outputs, dtype=x.dtype, device=x.device)
    parts, arrivals = (workspace or SplitWorkspace(x.device)).take(splits * n, tiles) if splits > 1 else (y, y)
    prologue = RMSNORM if norm_weight is not None else NONE
    codes, gs = w.codes, layout.group_constexpr
    registers = {"maxnreg": config.registers} if config.registers else {}
    launch(_packed_gemv_kernel, (tiles, splits), warmup,
           x, codes, w.scales, w.zeros if w.zeros is not None else w.scales,
           bias if bias is not None else codes, residual if residual is not None else codes,
           norm_weight if norm_weight is not None else codes, y, parts, arrivals, n, k, layout.groups, per_split,
           splits, eps, PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
           BN=config.bn, BK=bk, BITS=layout.bits, GS=gs, HAS_Z=w.zeros is not None,
           SPLIT_K=splits > 1, EXACT=x.dtype != torch.float32, EVEN=outputs % rows == 0 and k % bk == 0,
           ONE_GROUP=layout.groups == 1, POW2_GROUPS=layout.groups > 1 and pow2(gs) == gs,
           XB=_norm_block(k, 1, prologue), GLU=glu, ASM=not interpreting(),
           WIDE=layout.bits == 8 and x.dtype == torch.bfloat16, IDOT=config.idot, **launch_options(x.device),
           num_warps=config.warps, **registers)
    return None if warmup else y


def one_row_product(x: torch.Tensor, w: torch.Tensor | PackedMatrix, config: Tile, *,
                    workspace: SplitWorkspace | None = None, **kw) -> torch.Tensor | None:
    """One row's product on ``config``'s kernel: :func:`staged_gemv` for a staged tile, :func:`packed_gemv`
    for a packed weight, :func:`gemv` for a dense one; ``kw``: what it fuses, its output, ``warmup``."""
    if isinstance(config, StagedGemvConfig):
        return staged_gemv(x, w, config, workspace=workspace, **kw)
    if isinstance(w, PackedMatrix):
        return packed_gemv(x, w, config, workspace=workspace, **kw)
    return gemv(x, w, config=config, **kw)


def reference_product(x: torch.Tensor, w: torch.Tensor | PackedMatrix, outputs: torch.Tensor, *,
                      bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False) -> torch.Tensor:
    """What :func:`gemv` and :func:`packed_gemv` give for one row ``x`` at ``outputs`` (columns of
    the result), by torch, rounded where the eager layer rounds: RMSNorm, the product in float32
    with the weight dequantized in its scales' dtype, the bias, SiLU(gate)·up, the residual. Only
    the rows of W those outputs read are dequantized."""
    dt = x.dtype
    h = x.float()
    if norm_weight is not None:
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        h = ((h * rstd).to(dt).float() * norm_weight.float()).to(dt).float()
    at = outputs.to(x.device)
    rows = torch.cat([at, at + w.shape[0] // 2]) if glu else at
    dense = dequantized_rows(w.codes, w.scales, w.zeros, w.layout, rows) if isinstance(w, PackedMatrix) else w[rows]
    y = (h @ dense.float().t()).to(dt)
    if bias is not None:
        y = (y.float() + bias[rows].float()).to(dt)
    if glu:
        gate, up = y[:, :len(at)].float(), y[:, len(at):].float()
        y = ((gate * torch.sigmoid(gate)).to(dt).float() * up).to(dt)
    if residual is not None:
        y = (y.float() + residual[:, at].float()).to(dt)
    return y.float()


def right_tiles(x: torch.Tensor, w: torch.Tensor | PackedMatrix, candidates, out: torch.Tensor,
                run: Callable, **kw) -> tuple[list, dict[str, str]]:
    """The ``candidates`` whose product ``run(x, w, tile, out=out, **kw)`` equals
    :func:`reference_product` within bf16's rounding (:func:`~edgeinfer.quant.kernels.divergence`) at
    :func:`~edgeinfer.quant.kernels.checked_outputs`, and each other tile's first divergence by name."""
    n = w.shape[0] // 2 if kw.get("glu") else w.shape[0]
    outputs = checked_outputs(n)
    right, wrong = checked_tiles(candidates, lambda tile: run(x, w, tile, out=out, **kw),
                                 reference_product(x, w, outputs, **kw), outputs)
    return right, {_config_name(tile): why for tile, why in wrong.items()}


def _config_name(c: Tile) -> str:
    if isinstance(c, StagedGemvConfig):
        return f"staged/{c.warps}w/split{c.split}" + (f"/early{c.early}" if c.early is not None else "")
    if isinstance(c, PackedGemvConfig):
        return (f"{c.bn}x{c.bk}/{c.warps}w/split{c.split}" + (f"/r{c.registers}" if c.registers else "")
                + ("/idot" if c.idot else ""))
    return f"{c.bn}x{c.bk}/{c.warps}w/{c.stages}s"


def _nbytes(w: torch.Tensor | PackedMatrix) -> int:
    """Bytes a product reads of its weight."""
    return w.nbytes if isinstance(w, PackedMatrix) else w.numel() * w.element_size()


class FusedDecode:
    """The decoder's layers around the paged attention kernel: the five kernels above for
    ``MAX_GEMV_ROWS`` rows or fewer; for 2 to 16 rows of 4-bit weights, the staged products
    (:func:`staged.staged_mm`) with the norms, bias, residuals and SiLU·up fused as at one row,
    where the few-row tuner chose the staged kernel for every product of the layer
    (:meth:`row_tiles`); otherwise the layer's own :meth:`DecoderLayer.qkv` and
    :meth:`DecoderLayer.after_attention` (cuBLAS or packed products; ``halves`` may give them
    compiled) on either side of the same attention, which reads the past where it lies in the
    pool rather than gathered into a copy. Weights must be stored ``[out, in]`` row-major
    (``cuda_graphs._relayout(decoder, out_major=True)``)."""

    def __init__(self, decoder, halves: tuple[Callable, Callable] | None = None) -> None:
        cfg = decoder.cfg
        if cfg.head_dim % 2 or cfg.head_dim > 256:
            raise ValueError(f"head_dim={cfg.head_dim} is odd or over 256")
        # The kernels are the Llama/Qwen2/Qwen3 layer (RoPE applied to q and k as the product left
        # them, after Qwen3's per-head norms); CUDA graphs of the compiled layers serve the rest.
        missing = cfg.gemma_features()
        if missing:
            raise ValueError(f"the fused step does not implement {', '.join(missing)}")
        self.decoder = decoder
        self.cfg = cfg
        # (qkv, after_attention) as functions of (layer, ...): the rows past MAX_GEMV_ROWS
        self.halves = halves or (DecoderLayer.qkv, DecoderLayer.after_attention)
        self.configs: dict[str, Tile] = {}
        self.report: dict[str, dict] = {}  # per product: its tile and timings
        self.step_report: dict | None = None  # what choosing the tiles by whole-step time changed
        self.tiles_source: str | None = None  # "timed" here, or "cache": kept by an earlier process
        self.compiled_ahead: dict | None = None  # what compile_ahead did before the timings (none from the cache)
        # Partial sums and arrival counts of split packed products and of the attention's splits, one
        # kernel after another: sized by tuning and by the run before each capture.
        self.workspace = SplitWorkspace(decoder.norm.weight.device)
        # The step's inputs (lookup, RoPE) and greedy choice, a kernel each, in the same workspace
        # (torch's ops where ``$EDGEINFER_STEP_ENDS=0``).
        self.ends = StepEnds(decoder, self.workspace, kernels=step_ends_enabled())
        # Per row tile (kernels.row_tile) of 2 to 16 rows: the staged tiles the fused few-row layers
        # run, or None where they do not; and what decided it, for the report.
        self._row_tiles: dict[int, dict[str, StagedGemvConfig] | None] = {}
        self.rows_report: dict[int, dict[str, str] | str] = {}
        # What choosing those tiles by whole-step time did, per row tile (:meth:`_rows_in_step`), with
        # the budget and tile cache :meth:`tune` was given.
        self.rows_step_report: dict[int, dict] = {}
        self.step_budget_s = 0.0
        self._cache: TileCache | None = None

    @staticmethod
    def weight(p: torch.Tensor | PackedMatrix) -> torch.Tensor | PackedMatrix:
        """The ``[out, in]`` row-major matrix behind an ``[in, out]`` parameter (a packed one as it is)."""
        if isinstance(p, PackedMatrix):
            return p
        w = p.t()
        if not w.is_contiguous():
            raise ValueError("the fused decode step needs weights stored [out, in] row-major")
        return w

    def _products(self) -> dict[str, tuple[list[torch.Tensor], dict]]:
        """Each product's weights over all layers, and what it fuses (for timing)."""
        layers, d = self.decoder.layers, self.decoder
        first = layers[0]
        return {
            "qkv": ([self.weight(layer.qkv_t) for layer in layers],
                    {"bias": first.qkv_bias, "norm_weight": first.input_norm.weight, "eps": first.input_norm.eps}),
            "o": ([self.weight(layer.o_t) for layer in layers], {"bias": first.o_bias, "residual": True}),
            "gate_up": ([self.weight(layer.gate_up_t) for layer in layers],
                        {"bias": first.gate_up_bias, "norm_weight": first.post_attention_norm.weight,
                         "eps": first.post_attention_norm.eps, "glu": True}),
            "down": ([self.weight(layer.down_t) for layer in layers], {"bias": first.down_bias, "residual": True}),
            "lm_head": ([self.weight(d.lm_head_t)], {"norm_weight": d.norm.weight, "eps": d.norm.eps}),
        }

    def tune(self, step_budget_s: float = 0.0, cache: TileCache | None = None, steps: Steps | None = None) -> None:
        """Choose every product's tile at batch 1: first alone (:meth:`_tune_alone`), then, for up
        to ``step_budget_s`` seconds, by the whole step's time (:meth:`_tune_in_step`; 0 skips it).
        Each trial of the second is a capture of two steps and their replays; it ends sooner
        where a round of the products changes nothing.

        With a ``cache`` (:mod:`edgeinfer.tile_cache`), tiles an earlier process chose for the same
        products on the same GPU and kernels are taken instead, where that process's step tuning
        had at least ``step_budget_s``; tiles chosen here are stored there. ``steps`` hears of
        every timing, a phase alone and one in the step. The budget and the cache serve the few-row
        layers' tiles too, chosen at their row tile's first use (:meth:`row_tiles`)."""
        self.step_budget_s, self._cache = step_budget_s, cache
        ident = device_identity(self.decoder.norm.weight.device) if cache is not None else None
        key = self.tiles_key() if ident is not None else None
        if key is not None:
            kept = cache.get(FUSED_TILES, key, ident)
            if kept is not None and self.restore(kept, step_budget_s):
                return
        steps = steps or NoSteps()
        ranked = self._tune_alone(steps)
        if step_budget_s > 0:
            self._tune_in_step(ranked, step_budget_s, steps)
        self.tiles_source = "timed"
        if key is not None:
            cache.put(FUSED_TILES, key, self.kept(step_budget_s), ident)

    def tiles_key(self) -> dict:
        """What the tiles were timed for: each product's shape, weight format and what it fuses, the
        layers the step runs (the step's attention is timed with them), and whether the staged
        kernel's tiles and the integer-dot tiles were among the candidates (:func:`staged.enabled`,
        :func:`integer_dot_enabled`)."""
        cfg = self.cfg
        products = {}
        for name, (weights, kw) in self._products().items():
            w = weights[0]
            fmt = ({"bits": w.bits, "groups": w.layout.groups, "group": w.layout.group_constexpr,
                    "zeros": w.zeros is not None} if isinstance(w, PackedMatrix) else {"dtype": str(w.dtype)})
            products[name] = {"shape": list(w.shape), **fmt, "bias": kw.get("bias") is not None,
                              "norm": kw.get("norm_weight") is not None, "residual": bool(kw.get("residual")),
                              "glu": bool(kw.get("glu"))}
        return {"products": products, "dtype": str(self.decoder.norm.weight.dtype), "layers": cfg.num_layers,
                "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "qk_norm": cfg.qk_norm, "staged": staged.enabled(), "integer_dot": integer_dot_enabled()}

    def kept(self, step_budget_s: float) -> dict:
        """The tiles and their timings as :meth:`restore` takes them back."""
        return {"configs": {name: {"packed": not isinstance(c, GemvConfig), "kind": _TILE_KINDS[type(c)], **asdict(c)}
                            for name, c in self.configs.items()},
                "step_budget_s": step_budget_s, "report": self.report, "step_report": self.step_report}

    def restore(self, kept: dict, step_budget_s: float) -> bool:
        """Take the tiles of :meth:`kept` where they cover every product with a tile of the right
        kind and were tuned in the step for at least ``step_budget_s``; False (nothing changed) else."""
        try:
            if float(kept["step_budget_s"]) < step_budget_s:
                return False
            configs = {}
            for name, (weights, _) in self._products().items():
                fields = dict(kept["configs"][name])
                packed = fields.pop("packed")
                kind = fields.pop("kind", "packed" if packed else "dense")  # files kept before staged tiles
                if kind not in _TILE_CLASSES or packed != isinstance(weights[0], PackedMatrix) or \
                        (kind == "dense") == packed:
                    return False
                configs[name] = _TILE_CLASSES[kind](**fields)
            report, step_report = dict(kept["report"]), kept["step_report"]
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        self.configs, self.report, self.step_report = configs, report, step_report
        self.tiles_source = "cache"
        return True

    def timed_products(self) -> dict[str, tuple[list, torch.Tensor, dict, list[torch.Tensor]]]:
        """Per product, what a product is timed alone on, as a step calls it: every layer's weight, a
        random row x, what it fuses (a random residual where it adds one) and an output per layer."""
        timed = {}
        for name, (weights, kw) in self._products().items():
            x, kw, out = self._probe(weights[0], kw, rows=1)
            timed[name] = weights, x, kw, [out] + [torch.empty_like(out) for _ in weights[1:]]
        return timed

    def _probe(self, w: torch.Tensor | PackedMatrix, kw: dict, rows: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """Random ``rows`` rows of ``w``'s input, what ``kw`` says the product fuses (a random residual
        where it adds one) and an output for them: what a product is checked and timed on."""
        dtype, device = self.decoder.norm.weight.dtype, self.decoder.norm.weight.device
        n, k = w.shape
        kw = dict(kw)
        if kw.pop("residual", False):
            kw["residual"] = torch.randn(rows, n, dtype=dtype, device=device)
        out = torch.empty(rows, _outputs(n, bool(kw.get("glu")), None), dtype=dtype, device=device)
        return torch.randn(rows, k, dtype=dtype, device=device), kw, out

    def _tune_alone(self, steps: Steps) -> dict[str, list[Tile]]:
        """Time every candidate tile on every product at batch 1, going through all layers' weights
        (as a step does: from memory, not from the L2 cache), and keep the fastest; cuBLAS is timed
        beside it for the report (on the dense weights; a packed product has no cuBLAS twin).
        A tile whose outputs are not torch's (:func:`right_tiles`) is not timed; where no tile of a
        product is right this raises, and the engine decodes through the compiled layers.
        Returns each product's candidates, fastest first."""
        dtype, device = self.decoder.norm.weight.dtype, self.decoder.norm.weight.device
        ranked = {}
        timed = self.timed_products()
        if device.type == "cuda":  # every candidate compiled on threads first: the timings then compile nothing
            ahead = compile_ahead((lambda c=c, w=ws[0], x=x, kw=kw, o=outs[0]: self._product(x, w, c, out=o, warmup=True, **kw)
                           for ws, x, kw, outs in timed.values() for c in _candidates(ws[0], dtype, kw.get("glu", False))),
                          steps)
            self.compiled_ahead = asdict(ahead) if ahead is not None else None
        advance = steps.phase(TILES_ALONE, sum(len(_candidates(ws[0], dtype, kw.get("glu", False)))
                                               for ws, _, kw, _ in timed.values()))
        for name, (weights, x, kw, outs) in timed.items():
            n, k = weights[0].shape
            times = {}
            packed = isinstance(weights[0], PackedMatrix)
            tiles = _candidates(weights[0], dtype, kw.get("glu", False))
            right, wrong = right_tiles(x, weights[0], tiles, outs[0], self._product, **kw)
            if not right:  # the engine falls back to the compiled layers, with a warning
                first = next(iter(wrong))
                raise RuntimeError(f"every tile of the fused step's {name} product gave wrong outputs on this GPU "
                                   f"(tile {first}: {wrong[first]})")
            for c in tiles:
                if c in right:
                    calls = [lambda w=w, o=o, c=c: self._product(x, w, c, out=o, **kw) for w, o in zip(weights, outs)]
                    times[c] = graph_time_us(calls)
                advance()
            best = min(times, key=times.get)
            self.configs[name] = best
            mb = _nbytes(weights[0]) / 1e6
            report = {"shape": [n, k], "weight": f"{weights[0].bits}-bit packed" if packed else str(dtype),
                      "mb": round(mb, 3), "config": _config_name(best), "us": round(times[best], 2),
                      "gb_s": round(mb / times[best] * 1e3, 1)}
            if not packed:
                cublas = graph_time_us([lambda w=w: torch.mm(x, w.t()) for w in weights])
                report.update(cublas_us=round(cublas, 2), cublas_gb_s=round(mb / cublas * 1e3, 1))
            report["candidates_us"] = {_config_name(c): round(t, 2) for c, t in times.items()}
            if wrong:  # tiles not timed: their outputs were not torch's
                report["wrong_outputs"] = wrong
            self.report[name] = report
            ranked[name] = sorted(times, key=times.get)
        return ranked

    def _tune_in_step(self, ranked: dict[str, list[Tile]], budget_s: float,
                      steps: Steps) -> None:
        """Change the tiles where the whole step gets faster (:func:`.step_tuning.descend`), timing
        a batch-1 step over a past of :data:`STEP_TUNING_CONTEXT` positions in a scratch pool, over
        each product's :data:`STEP_CANDIDATES` fastest tiles alone."""
        step = self._scratch_step(STEP_TUNING_CONTEXT)
        advance = steps.phase(TILES_IN_STEP, None)  # as many timings as the budget and rounds allow

        def step_us(configs):
            self.configs = configs
            us = step_time_us(step)
            advance()
            return us

        started = time.monotonic()
        found = descend(self.configs, {name: tiles[:STEP_CANDIDATES] for name, tiles in ranked.items()},
                        step_us, budget_s)
        self.configs = found.choices
        for name, (alone, chosen) in found.changed.items():  # the kept tile's own timing, from the first pass
            report = self.report[name]
            us = report["candidates_us"][_config_name(chosen)]
            report.update(alone=_config_name(alone), config=_config_name(chosen), us=us,
                          gb_s=round(report["mb"] / us * 1e3, 1))
        self.step_report = found.report(STEP_TUNING_CONTEXT, time.monotonic() - started)

    def _scratch_step(self, context: int, rows: int = 1) -> Callable[[], object]:
        """One step of ``rows`` rows through all layers and the head, each row over a past of
        ``context`` positions in pages of its own (blocks of 16) of a pool of its own, writing its new
        K/V at slot ``context``. Rows that shared their pages would find them in L2."""
        cfg = self.cfg
        weight = self.decoder.norm.weight
        blocks = -(-(context + 1) // STEP_TUNING_BLOCK)
        pool = (cfg.num_layers, rows * blocks, STEP_TUNING_BLOCK, cfg.num_kv_heads, cfg.head_dim)
        k_pool = torch.randn(pool, dtype=weight.dtype, device=weight.device)
        v_pool = torch.randn_like(k_pool)
        x = torch.randn(rows, cfg.hidden_size, dtype=weight.dtype, device=weight.device)
        cos = torch.ones(rows, cfg.head_dim, dtype=weight.dtype, device=weight.device)
        sin = torch.zeros_like(cos)
        tables = torch.arange(rows * blocks, device=weight.device).view(rows, blocks)
        context_lens = torch.full((rows,), context, device=weight.device)
        valid = torch.ones(rows, dtype=torch.long, device=weight.device)
        return lambda: self.layers(x, cos, sin, k_pool, v_pool, tables, context_lens, valid)

    def _product(self, x, w, config, **kw):  # kw: what the product fuses, its output, warmup
        return one_row_product(x, w, config, workspace=self.workspace, **kw)

    def _gemv(self, name, x, w, **kw):
        if not self.configs:
            if x.device.type != "cuda":  # the interpreter: nothing to time
                self.configs = {name: _candidates(ws[0])[0] for name, (ws, _) in self._products().items()}
            elif torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the fused decode kernels must be tuned before a capture")
            else:
                self.tune()
        return self._product(x, w, self.configs[name], **kw)

    def layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
               valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [M, hidden] -> last-norm'd logits [M, vocab], and the new K/V [layers, M, 1, kvh, hd]
        (None when ``valid`` is given: then they were written into the pools)."""
        cfg = self.cfg
        m = x.shape[0]
        # The products on either side of the attention: Triton's at a row, the staged ones fused at 2 to
        # 16 rows where they take every product, the layer's own otherwise.
        if m <= MAX_GEMV_ROWS:
            before, after, head = partial(self._qkv, self._gemv), partial(self._after, self._gemv), self._head_gemv
        elif (tiles := self.row_tiles(x)) is not None:
            product = partial(self._tiled_rows, tiles)
            before, after, head = partial(self._qkv, product), partial(self._after, product), self._head_rows
        else:
            before, after, head = (*self.halves, self._head_rows)
        new_k = new_v = None
        if valid is None:
            new_k = torch.empty(cfg.num_layers, m, 1, cfg.num_kv_heads, cfg.head_dim, dtype=x.dtype, device=x.device)
            new_v = torch.empty_like(new_k)
        for i, layer in enumerate(self.decoder.layers):
            attn = paged_attention(before(layer, x), cos, sin, k_pool[i], v_pool[i], tables, context_lens,
                                   heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, valid=valid,
                                   new_kv=None if valid is not None else (new_k[i], new_v[i]),
                                   qk_norm=None if layer.q_norm is None else
                                   (layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps),
                                   workspace=self.workspace)
            x = after(layer, x, attn)
        return head(x), new_k, new_v

    ROW_PRODUCTS = ("qkv", "o", "gate_up", "down")  # the products the few-row layers fuse (the head is the layer's)

    def row_tiles(self, x: torch.Tensor) -> dict[str, StagedGemvConfig] | None:
        """The staged tiles the layers' four products run on for ``x``'s rows (2 to 16), fused, or None
        where the layer's own products run: where ``$EDGEINFER_FUSED_ROWS=0``, a product is not 4-bit
        packed, the few-row tuner (``kernels.tuned_config``, which times the staged tiles beside the
        others) chose another kernel for it, some layer's weight is one the tile cannot take, or
        the fused product's outputs are not torch's (:func:`right_tiles`, checked once a row tile).
        Then, with a step budget (:meth:`tune`'s) and ``$EDGEINFER_ROWS_IN_STEP=1``, the tiles the whole
        few-row step runs fastest on (:meth:`_rows_in_step`). Decided at the first call of a row tile outside a capture (the
        warm-up before it) and kept; why is in :attr:`rows_report`."""
        m = x.shape[0]
        if not fused_rows_enabled() or not 1 < m <= staged.MAX_ROWS or x.device.type != "cuda":
            return None
        bm = row_tile(m)
        if bm in self._row_tiles:
            return self._row_tiles[bm]
        if torch.cuda.is_current_stream_capturing():  # nothing is timed or checked inside a capture
            return None
        tiles, why = {}, {}
        for name, (weights, kw) in self._products().items():
            if name not in self.ROW_PRODUCTS:
                continue
            tile = self._fused_row_tile(weights, kw, x)
            why[name] = _config_name(tile) if isinstance(tile, StagedGemvConfig) else tile
            if not isinstance(tile, StagedGemvConfig):
                break
            tiles[name] = tile
        chosen = tiles if len(tiles) == len(self.ROW_PRODUCTS) else None
        if chosen is not None and self.step_budget_s > 0 and rows_in_step_enabled():
            try:
                chosen = self._rows_in_step(bm, chosen)
            except Exception as exc:  # noqa: BLE001 - out of memory for the scratch pool, a kernel refused: the start stands
                self.rows_step_report[bm] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                warnings.warn(f"the few-row layers' tiles at {bm} rows were not timed in the step, "
                              f"they keep the tiles chosen alone: {self.rows_step_report[bm]['error']}")
            why = {name: _config_name(tile) for name, tile in chosen.items()}
        self._row_tiles[bm] = chosen
        self.rows_report[bm] = why if chosen is not None else f"layer's own products: {why}"
        return chosen

    def _rows_in_step(self, bm: int, start: dict[str, StagedGemvConfig]) -> dict[str, StagedGemvConfig]:
        """The few-row layers' tiles at ``bm`` rows by whole-step time, as batch 1's are after their
        tiles alone (:func:`.step_tuning.descend`, for up to :attr:`step_budget_s`): from the tiles the
        few-row tuner chose, each timed alone and unfused, over every staged tile a product can take
        fused (:meth:`_row_candidates`), timing steps of ``bm`` rows, each row over its own past of
        :data:`STEP_TUNING_CONTEXT` positions. Kept in the tile cache by row tile and by the tiles it
        started from; what it did is in :attr:`rows_step_report`."""
        device = self.decoder.norm.weight.device
        ident = device_identity(device) if self._cache is not None else None
        key = {**self.tiles_key(), "rows": bm, "start": {name: asdict(tile) for name, tile in start.items()}}
        if ident is not None and (kept := self._restore_rows(bm, self._cache.get(FUSED_ROW_TILES, key, ident), start)):
            return kept
        products = self._products()
        candidates = {name: self._row_candidates(*products[name], bm, start[name]) for name in self.ROW_PRODUCTS}
        step = self._scratch_step(STEP_TUNING_CONTEXT, rows=bm)

        def step_us(choices):
            self._row_tiles[bm] = choices  # what layers() runs at this row tile while it is timed
            return step_time_us(step)

        started = time.monotonic()
        found = descend(start, candidates, step_us, self.step_budget_s)
        del step  # the scratch pool (477 MB at 16 rows of a 2B model): on a Jetson's shared memory, given back
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.rows_step_report[bm] = {
            **found.report(STEP_TUNING_CONTEXT, time.monotonic() - started),
            "changed": {name: [_config_name(a), _config_name(b)] for name, (a, b) in found.changed.items()}}
        if ident is not None:
            self._cache.put(FUSED_ROW_TILES, key, {
                "configs": {name: asdict(tile) for name, tile in found.choices.items()},
                "step_budget_s": self.step_budget_s, "report": self.rows_step_report[bm]}, ident)
        return found.choices

    def _restore_rows(self, bm: int, kept: dict | None,
                      start: dict[str, StagedGemvConfig]) -> dict[str, StagedGemvConfig] | None:
        """The tiles a cache entry of :meth:`_rows_in_step` holds for row tile ``bm``, where it covers
        every product and its descent had at least this budget; None else."""
        try:
            if kept is None or float(kept["step_budget_s"]) < self.step_budget_s:
                return None
            tiles = {name: StagedGemvConfig(**kept["configs"][name]) for name in start}
            report = {**kept["report"], "from_cache": True}
        except (KeyError, TypeError, ValueError):
            return None
        self.rows_step_report[bm] = report
        return tiles

    def _row_candidates(self, weights: list, kw: dict, bm: int, chosen: StagedGemvConfig) -> list[StagedGemvConfig]:
        """The staged tiles that can run one product of the few-row layers fused as ``kw`` says, at
        ``bm`` rows: every layer's weight fits (:func:`staged.unfit`) and the fused outputs are
        torch's (:meth:`_right_row_tiles`), compiled ahead; ``chosen`` (already checked) first."""
        w, glu, dtype = weights[0], bool(kw.get("glu")), self.decoder.norm.weight.dtype
        others = [t for t in staged.tiles_that_fit(w, dtype, glu)
                  if t != chosen and all(staged.unfit(v, dtype, glu, t) is None for v in weights)]
        right, _ = self._right_row_tiles(w, kw, bm, others, ahead=True)
        return [chosen] + right

    def _right_row_tiles(self, w: PackedMatrix, kw: dict, rows: int, tiles: list[StagedGemvConfig],
                         ahead: bool = False) -> tuple[list[StagedGemvConfig], dict[str, str]]:
        """Of ``tiles``, those whose product of ``w`` fused as ``kw`` says gives torch's outputs at
        ``rows`` rows (:func:`right_tiles`, on random rows and a random residual where it adds one),
        in their order, and why not for the others. ``ahead``: compiled on threads first (on a GPU)."""
        x, kw, out = self._probe(w, kw, rows)
        if ahead and x.device.type == "cuda":
            compile_ahead(lambda t=t: self._rows_product(x, w, t, out=out, warmup=True, **kw) for t in tiles)
        right, wrong = right_tiles(x, w, tiles, out, self._rows_product, **kw)
        return [t for t in tiles if t in right], wrong

    def _fused_row_tile(self, weights: list, kw: dict, x: torch.Tensor) -> StagedGemvConfig | str:
        """The staged tile one product of the few-row layers runs on for ``x``'s rows, fused as ``kw``
        says, or why none (:meth:`row_tiles`)."""
        w, m = weights[0], x.shape[0]
        if not isinstance(w, PackedMatrix):
            return f"{w.dtype} weights (not packed)"
        probe = torch.randn(m, w.shape[1], dtype=x.dtype, device=x.device)
        cfg = tuned_config(probe, w.codes, w.scales, w.zeros, w.layout)
        if not isinstance(cfg, StagedGemvConfig):
            return f"the few-row tuner chose {cfg} at {row_tile(m)} rows"
        glu = bool(kw.get("glu"))
        for i, v in enumerate(weights):
            if (reason := staged.unfit(v, x.dtype, glu, cfg)) is not None:
                return f"layer {i}: {reason}"
        _, wrong = self._right_row_tiles(w, kw, m, [cfg])
        return f"fused outputs not torch's: {next(iter(wrong.values()))}" if wrong else cfg

    def _rows_product(self, x, w, config, **kw):  # kw: what the product fuses, its output, warmup
        return staged_mm(x, w, config, workspace=self.workspace, **kw)

    def _tiled_rows(self, tiles, name, x, w, **kw):  # kw: what the product fuses
        return self._rows_product(x, w, tiles[name], **kw)

    # One layer's products as the fused step wires them, ``product(name, x, w, **fusions)`` being the
    # one-row Triton product (:meth:`_gemv`) or the few-row staged one (:meth:`_tiled_rows`).

    def _qkv(self, product: Callable, layer, x: torch.Tensor) -> torch.Tensor:
        return product("qkv", x, self.weight(layer.qkv_t), bias=layer.qkv_bias, norm_weight=layer.input_norm.weight,
                       eps=layer.input_norm.eps)

    def _after(self, product: Callable, layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = product("o", attn, self.weight(layer.o_t), bias=layer.o_bias, residual=x)
        act = product("gate_up", x, self.weight(layer.gate_up_t), bias=layer.gate_up_bias,
                      norm_weight=layer.post_attention_norm.weight, eps=layer.post_attention_norm.eps, glu=True)
        return product("down", act, self.weight(layer.down_t), bias=layer.down_bias, residual=x)

    def _head_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The head at several rows: the final norm, one kernel of the step's ends, then the
        vocabulary product the head's weight takes at that many rows."""
        return self.decoder.vocabulary(self.ends.norm(x))

    def _head_gemv(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.decoder.norm
        return self._gemv("lm_head", x, self.weight(self.decoder.lm_head_t), norm_weight=norm.weight, eps=norm.eps)

