"""A 4-bit product of a few rows on the tensor cores, the weight rebuilt in the MMA's own registers.

:func:`~edgeinfer.quant.kernels.packed_mm`'s Triton kernel rebuilds a tile of weight in registers
and then hands it to ``tl.dot``, which moves it through shared memory into the layout the tensor
cores read; on an H200 those stores conflict eight ways and the product of 16 rows runs no faster
than cuBLAS on the dense bf16 weight. This kernel is written in Gluon, Triton's layout-explicit
dialect, so the layouts are chosen rather than inferred:

* ``mma.sync`` m16n8k16 (Ampere's instruction, so it runs on Orin's sm_87 and on Hopper) with
  the weight as the A operand in the layout of ``k_width`` 8: a thread's fragment of a row is 8
  consecutive input columns, which is exactly one packed 32-bit word. The words are loaded in a
  layout whose values, taken apart in place, *are* that operand (:func:`word_layout`): no data
  moves between threads, no shared memory.
* A word becomes its eight values in 16-bit pairs: one ``prmt`` puts byte j (columns 2j, 2j+1)
  in the low half and, from the word shifted by 4, in the high half; one ``lop3`` masks the two
  codes into the mantissa of 128 (bf16) or 1024 (fp16); two ``fma.x2`` take off 2^m + z and
  multiply by the scale: the dequantized weight ``(q - z)·s`` rounded once, as
  :meth:`~edgeinfer.quant.weights.QuantizedWeight.dequantize` rounds it: 17 instructions a word
  (a shift, then four ``prmt``, four ``lop3``, eight ``fma.x2``), the multiply-adds left to the
  tensor cores, where :func:`~edgeinfer.backends.torch.triton_decode.packed_gemv`'s K loop spends
  some 35 a word and does its own.
* x is the B operand, read straight from memory into its layout (8 consecutive columns a
  thread, one 16-byte load); rows past M read zeros. With ``X_SHARED`` a CTA instead copies its
  split's columns of x into shared memory once, and each step reads its slice from there: only
  the weights' operands are then held in registers ahead (at 16 rows x's steps were most of them).
* With ``WIDE`` a lane's words of a K step lie side by side in memory (16 bytes, one load, at a
  step of 128 columns) rather than one word in four: the MMA's K order is then a permutation of
  the step's columns (a lane's words are the step's 32-column blocks, each one word of the
  operand's fragment), and x is read, or copied into shared memory, in the same permutation,
  which a sum over K does not see. The words of a step then take a quarter of the loads.
* With ``STAGED`` (and ``X_SHARED``) every step's words are copied into shared memory too, all
  before the first multiply, a commit group a step, and step i waits for the copies up to its own:
  every byte of a program is in flight at once without holding a register, and the arithmetic
  follows the copies as they land (:mod:`edgeinfer.quant.staged` does so at one row). Right on an
  H200 but no faster there at 16 rows (docs/gpu-kernels.md): the tuner times these tiles only
  with ``EDGEINFER_STAGED_MMA=1``.
* K is split when N alone gives too few programs; each split writes its partial sums and the
  last to arrive adds them in split order (the same bits on every run) and writes the output,
  as :func:`~edgeinfer.quant.kernels.split_total` does for the Triton kernels (a Gluon kernel
  calls Gluon functions only, so this one and ``_join4`` are written again here).

Gluon is experimental in Triton 3.6; where it is missing or refuses the kernel, the Triton
kernel runs instead (:func:`unavailable` says why).
"""

from __future__ import annotations

import functools

import torch

from edgeinfer.device import cuda_capability
from edgeinfer.quant.launching import launch

try:  # the import decides whether this kernel exists at all
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton; older Triton without Gluon
    gluon = None


def _dequantize_asm(magic: int, one: int, fma: str) -> str:
    """PTX for word ``$8``'s eight values as 16-bit floats ``$0..$7`` in column order, scale ``$9``
    and ``-(2^m + z)`` ``$10`` (16-bit floats); ``magic`` is 2^m twice, ``one`` 1.0 twice."""
    lines = [".reg .b32 h, p, m, o, one, nz, s2, z2;", "mov.b32 m, 0x000F000F;", f"mov.b32 o, {magic:#010x};",
             f"mov.b32 one, {one:#010x};", "mov.b32 nz, 0x80008000;", "mov.b32 s2, {$9, $9};",
             "mov.b32 z2, {$10, $10};", "shr.u32 h, $8, 4;"]
    for j in range(4):
        select = j | j << 4 | (4 + j) << 8 | (4 + j) << 12  # byte j of the word low, of the word >> 4 high
        lines += [f"prmt.b32 p, $8, h, {select:#06x};", "lop3.b32 p, p, m, o, 0xea;", f"{fma} p, p, one, z2;",
                  f"{fma} p, p, s2, nz;", f"mov.b32 {{${2 * j}, ${2 * j + 1}}}, p;"]
    return "{\n" + "\n".join(lines) + "\n}"


# (2^m as two 16-bit floats, 1.0 as two, the paired fma) for bf16 (2^7: 7 mantissa bits hold a 4-bit
# code) and fp16 (2^10)
BF16_DEQUANTIZE = _dequantize_asm(0x43004300, 0x3F803F80, "fma.rn.bf16x2")
F16_DEQUANTIZE = _dequantize_asm(0x64006400, 0x3C003C00, "fma.rn.f16x2")
MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 with bf16, fma.rn.bf16x2


@functools.cache  # one layout object per tile, not one a call
def word_layout(bn: int, bk: int, warps: int, wide: bool = False):
    """The layout of ``[bn, bk / 8]`` packed words whose values, each word's 8 joined in place, are
    the A operand (mma v2, ``k_width`` 8, ``warps`` along the rows) of a ``[bn, bk]`` tile: that
    operand's bases with the three register bits of a word's columns taken out (the kernel asserts
    that the two agree, so a Triton that lays the operand out otherwise refuses to compile it).
    ``wide``: lane c holds words ``R·c .. R·c + R - 1`` of a row (R = bk / 32, side by side in
    memory), where the operand's lane c holds word c of each 32-column block: the same registers,
    with the step's columns permuted (:func:`_weight_tile`)."""
    if wide:
        per_lane = bk // 32
        registers = [[0, 1 << b] for b in range(per_lane.bit_length() - 1)] + [[8, 0]]
        lanes = [[0, per_lane], [0, 2 * per_lane], [1, 0], [2, 0], [4, 0]]
    else:
        registers = [[8, 0]] + [[0, (1 << b) // 8] for b in range(5, bk.bit_length() - 1)]
        lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    rows = 16 * warps
    while rows < bn:
        registers.append([rows, 0])
        rows *= 2
    return gl.DistributedLinearLayout(
        reg_bases=registers, lane_bases=lanes,
        warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)], block_bases=[], shape=[bn, bk // 8])


if gluon is not None:
    # a CTA's barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` in 3.9
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # a copy into shared memory: ``async_copy_global_to_shared`` in Triton 3.6, ``async_load`` in 3.9
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _BF16_DEQUANTIZE = gl.constexpr(BF16_DEQUANTIZE)
    # a step's words in shared memory as they lie, row after row (a lane's 16 bytes are its own)
    _WORDS_SHARED = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    _F16_DEQUANTIZE = gl.constexpr(F16_DEQUANTIZE)

    @gluon.jit
    def _join4(a, b, c, d):
        """[R, W] four times -> [R, W, 2, 2], read in order a, b, c, d once flattened."""
        return gl.join(gl.join(a, c), gl.join(b, d))

    @gluon.jit
    def _weight_tile(words, s, nb, BN: gl.constexpr, BK: gl.constexpr, LA: gl.constexpr, BF16: gl.constexpr,
                     WIDE: gl.constexpr = False):
        """``(q - z)·s`` of ``words`` [BN, BK/8] as the A operand [BN, BK] (``nb`` = -(2^m + z)); with
        ``WIDE`` (:func:`word_layout`) its column 32b + 8c + e holds the step's column 8Rc + 8b + e
        (R = BK / 32 words a lane), as :func:`_operand_columns` reads x."""
        if BF16:
            v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
                _BF16_DEQUANTIZE, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [words, s, nb], dtype=(gl.bfloat16,) * 8,
                is_pure=True, pack=1)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
                _F16_DEQUANTIZE, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [words, s, nb], dtype=(gl.float16,) * 8,
                is_pure=True, pack=1)
        tile = gl.reshape(gl.join(_join4(v0, v2, v4, v6), _join4(v1, v3, v5, v7)), [BN, BK])
        if WIDE:  # [BN, lane c, word b, value e] -> [BN, b, c, e]: moves no value, renames its column
            tile = gl.reshape(gl.permute(gl.reshape(tile, [BN, 4, BK // 32, 8]), [0, 2, 1, 3]), [BN, BK])
            return gl.convert_layout(tile, LA)
        return gl.convert_layout(tile, LA, assert_trivial=True)

    @gluon.jit
    def _operand_columns(rk, BK: gl.constexpr, WIDE: gl.constexpr):
        """The step's column that the operands' column ``rk`` holds (:func:`_weight_tile`)."""
        if WIDE:
            return rk % 8 + (rk // 8) % 4 * (BK // 4) + rk // 32 * 8
        return rk

    @gluon.jit
    def _step_operands(words_at, words_ok, S, Z, x_at, x_ok, rn, n_ok, G, k0,
                       GS: gl.constexpr, HAS_Z: gl.constexpr, MAGIC: gl.constexpr, LW: gl.constexpr,
                       X_SHARED: gl.constexpr):
        """One K step's words, scales, ``-(2^m + z)`` and x, issued together (nothing here waits);
        with ``X_SHARED`` x is in shared memory already, and its slot is 0."""
        dt = x_at.dtype.element_ty
        words = gl.load(words_at + k0 // 8, mask=words_ok, other=0)
        at = rn * G + k0 // GS
        s = gl.load(S + at, mask=n_ok, other=0.0).to(dt)
        if HAS_Z:
            nb = (-MAGIC - gl.load(Z + at, mask=n_ok, other=0.0).to(gl.float32)).to(dt)
        else:
            nb = gl.full(s.shape, -MAGIC - 8.0, dt, layout=gl.SliceLayout(1, LW))
        x = 0
        if not X_SHARED:
            x = gl.load(x_at + k0, mask=x_ok, other=0.0)
        return words, s, nb, x

    @gluon.jit
    def _x_to_shared(X, M, stride_x, start, end, BK: gl.constexpr, BM: gl.constexpr, X_STEPS: gl.constexpr,
                     WARPS: gl.constexpr, WIDE: gl.constexpr = False):
        """Start copying x's columns [start, end) for BM rows (zeros past M) into shared memory, a
        [BK, BM] slice a K step, 16 bytes a copy (``cp.async``: all in flight at once, no register
        held), each CTA reading them once rather than each warp once a step. The copies are waited
        for by :func:`_x_arrived`."""
        along_k: gl.constexpr = BK // 8 if BK // 8 < 32 else 32
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[along_k, 32 // along_k],
                                            warps_per_cta=[1, WARPS], order=[0, 1])
        shared: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[0, 1])
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [X_STEPS, BK, BM], shared)
        rk = gl.arange(0, BK, layout=gl.SliceLayout(1, xl))
        rm = gl.arange(0, BM, layout=gl.SliceLayout(0, xl))
        # with WIDE, row rk of a step's slice holds the column the operands' column rk stands for: the
        # permutation moves whole runs of 8 columns, so each copy is still 16 contiguous bytes
        at = X + gl.expand_dims(rm * stride_x, 0) + gl.expand_dims(_operand_columns(rk, BK, WIDE), 1) + start
        ok = gl.expand_dims(rm < M, 0)
        for step in range(0, (end - start) // BK):
            _async_load(x_smem.index(step), at + step * BK, mask=ok)
        async_copy.commit_group()
        return x_smem

    @gluon.jit
    def _x_arrived():
        """Every copy :func:`_x_to_shared` started has landed, this thread's and every other's."""
        async_copy.wait_group(0)
        _cta_barrier()

    @gluon.jit
    def _staged_steps(acc, x_smem, words_at, words_ok, S, Z, rn, n_ok, G, start, BN: gl.constexpr, BK: gl.constexpr,
                      GS: gl.constexpr, HAS_Z: gl.constexpr, MAGIC: gl.constexpr, LW: gl.constexpr, LA: gl.constexpr,
                      LB: gl.constexpr, BF16: gl.constexpr, WIDE: gl.constexpr, STEPS: gl.constexpr):
        """``acc`` plus the split's STEPS steps, their words copied into shared memory all at once (a
        buffer and a commit group a step, after x's: ``cp.async`` holds no register, so every step's
        bytes are in flight together) and each step multiplied once the copies up to its own have
        landed, while the later ones still arrive (as :mod:`edgeinfer.quant.staged` does at one row).
        The steps' scales and ``-(2^m + z)`` are asked for first too, kept in registers."""
        dt = S.dtype.element_ty  # the activations' dtype too (unavailable refuses others)
        w_smem = ()
        for i in gl.static_range(STEPS):
            w_smem = w_smem + (gl.allocate_shared_memory(gl.int32, [BN, BK // 8], _WORDS_SHARED),)
            _async_load(w_smem[i], words_at + (start + i * BK) // 8, mask=words_ok)
            async_copy.commit_group()
        scales = ()
        less = ()
        for i in gl.static_range(STEPS):
            at = rn * G + (start + i * BK) // GS
            scales = scales + (gl.load(S + at, mask=n_ok, other=0.0).to(dt),)
            if HAS_Z:
                less = less + ((-MAGIC - gl.load(Z + at, mask=n_ok, other=0.0).to(gl.float32)).to(dt),)
            else:
                less = less + (gl.full(rn.shape, -MAGIC - 8.0, dt, layout=gl.SliceLayout(1, LW)),)
        for i in gl.static_range(STEPS):
            async_copy.wait_group(STEPS - 1 - i)  # this thread's copies up to step i (and x's) have landed
            _cta_barrier()  # and every other thread's
            a = _weight_tile(w_smem[i].load(LW), gl.expand_dims(scales[i], 1), gl.expand_dims(less[i], 1), BN, BK, LA,
                             BF16, WIDE)
            acc = mma_v2(a, x_smem.index(i).load(LB), acc)
        return acc

    @gluon.jit
    def _mma_mm_kernel(X, Q, S, Z, Y, PARTS, ARRIVALS, M, N, K, G, stride_x, stride_y, per_split, splits,
                       BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, GS: gl.constexpr,
                       HAS_Z: gl.constexpr, SPLIT_K: gl.constexpr, WARPS: gl.constexpr, LW: gl.constexpr,
                       BF16: gl.constexpr, MAGIC: gl.constexpr, AHEAD: gl.constexpr,
                       X_SHARED: gl.constexpr = False, X_STEPS: gl.constexpr = 1, WIDE: gl.constexpr = False,
                       STAGED: gl.constexpr = False, STEPS: gl.constexpr = 1):
        """Y[m, n] = sum_k X[m, k] · W[n, k] for BN outputs and the BM (≤ 16) rows of X, over columns
        [split · per_split, (split + 1) · per_split); a K step of BK columns lies in one group. ``BF16``:
        X is bf16 (else fp16), whose mantissa holds a code over ``MAGIC`` (2^m). ``AHEAD`` (1 to 3)
        steps' operands are in flight while one multiplies: a step's words, scales and x all come from
        memory, and a product of a few rows has too few warps to hide one step's wait. ``X_SHARED``: x's
        columns of the split (at most ``X_STEPS`` steps) are put in shared memory first, once a CTA
        (:func:`_x_to_shared`), and each step's slice is read from there as it multiplies, so only the
        weights' operands are in flight ahead and x is read from the L2 once a CTA, not once a warp.
        ``STAGED`` (with ``X_SHARED``; each split exactly ``STEPS`` steps): every step's words are
        copied into shared memory too, all before the first multiply (:func:`_staged_steps`)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        tile = gl.program_id(0)
        split = gl.program_id(1)
        start = split * per_split
        end = gl.minimum(start + per_split, K)
        last = end - BK  # steps past the end read the last one again (no mask, no branch)
        rn = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
        n_ok = rn < N
        rows_at = rn * (K // 8)
        if WIDE:  # rows and steps start at whole steps (K and per_split are multiples of BK): a lane's
            rows_at = gl.multiple_of(rows_at, BK // 8)  # words of a step then load as one
            start = gl.multiple_of(start, BK)
            last = gl.multiple_of(last, BK)
        words_at = Q + gl.expand_dims(rows_at, 1) + gl.expand_dims(gl.arange(0, BK // 8, layout=gl.SliceLayout(0, LW)), 0)
        words_ok = gl.expand_dims(n_ok, 1)
        rk = gl.arange(0, BK, layout=gl.SliceLayout(1, lb))
        rm = gl.arange(0, BM, layout=gl.SliceLayout(0, lb))
        x_at = X + gl.expand_dims(rm * stride_x, 0) + gl.expand_dims(_operand_columns(rk, BK, WIDE), 1)
        x_ok = gl.expand_dims(rm < M, 0)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        if X_SHARED:
            x_smem = _x_to_shared(X, M, stride_x, start, end, BK, BM, X_STEPS, WARPS, WIDE)
        if STAGED:
            acc = _staged_steps(acc, x_smem, words_at, words_ok, S, Z, rn, n_ok, G, start, BN, BK, GS, HAS_Z, MAGIC,
                                LW, la, lb, BF16, WIDE, STEPS)
        else:
            w0, s0, z0, x0 = _step_operands(words_at, words_ok, S, Z, x_at, x_ok, rn, n_ok, G, start, GS, HAS_Z, MAGIC, LW, X_SHARED)
            if AHEAD >= 2:
                w1, s1, z1, x1 = _step_operands(words_at, words_ok, S, Z, x_at, x_ok, rn, n_ok, G,
                                                gl.minimum(start + BK, last), GS, HAS_Z, MAGIC, LW, X_SHARED)
            if AHEAD >= 3:
                w2, s2, z2, x2 = _step_operands(words_at, words_ok, S, Z, x_at, x_ok, rn, n_ok, G,
                                                gl.minimum(start + 2 * BK, last), GS, HAS_Z, MAGIC, LW, X_SHARED)
            if X_SHARED:  # x's copies were in flight while the first steps' weights were asked for
                _x_arrived()
            for k0 in range(start, end, BK):
                w, s, nb, x = w0, s0, z0, x0
                ahead = gl.minimum(k0 + AHEAD * BK, last)
                if AHEAD == 1:
                    w0, s0, z0, x0 = _step_operands(words_at, words_ok, S, Z, x_at, x_ok, rn, n_ok, G, ahead, GS, HAS_Z,
                                                    MAGIC, LW, X_SHARED)
                elif AHEAD == 2:
                    w0, s0, z0, x0 = w1, s1, z1, x1
                    w1, s1, z1, x1 = _step_operands(words_at, words_ok, S, Z, x_at, x_ok, rn, n_ok, G, ahead, GS, HAS_Z,
                                                    MAGIC, LW, X_SHARED)
                else:
                    w0, s0, z0, x0 = w1, s1, z1, x1
                    w1, s1, z1, x1 = w2, s2, z2, x2
                    w2, s2, z2, x2 = _step_operands(words_at, words_ok, S, Z, x_at, x_ok, rn, n_ok, G, ahead, GS, HAS_Z,
                                                    MAGIC, LW, X_SHARED)
                a = _weight_tile(w, gl.expand_dims(s, 1), gl.expand_dims(nb, 1), BN, BK, la, BF16, WIDE)
                if X_SHARED:
                    x = x_smem.index((k0 - start) // BK).load(lb)
                acc = mma_v2(a, x, acc)
        rn_o = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        rm_o = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        ok = gl.expand_dims(rm_o < M, 0) & gl.expand_dims(rn_o < N, 1)
        out = Y + gl.expand_dims(rm_o * stride_y, 0) + gl.expand_dims(rn_o, 1)
        if SPLIT_K:  # partials at [split, m, n]; the last split to arrive adds them in split order
            at = gl.expand_dims(rm_o * N, 0) + gl.expand_dims(rn_o, 1)
            gl.store(PARTS + split * (M * N) + at, acc, mask=ok)
            _cta_barrier()  # every thread's partials are written before the count says so
            if gl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel") == splits - 1:
                total = gl.zeros([BN, BM], gl.float32, layout=mma)
                for j in range(0, splits):
                    total += gl.load(PARTS + j * (M * N) + at, mask=ok, other=0.0, cache_modifier=".cg")
                gl.store(out, total.to(Y.dtype.element_ty), mask=ok)
                gl.atomic_xchg(ARRIVALS + tile, 0)
        else:
            gl.store(out, acc.to(Y.dtype.element_ty), mask=ok)


def unavailable(x: torch.Tensor, scales_dtype: torch.dtype, bits: int, group: int, n: int, k: int) -> str | None:
    """None when :func:`mma_mm` can take this product, else why not."""
    if gluon is None:
        return "Triton's Gluon is not installed"
    if x.device.type != "cuda":
        return "not a CUDA device"
    if cuda_capability(x.device) < MIN_CAPABILITY:
        return "the tensor cores' bf16 mma needs sm_80 or later"
    if bits != 4:
        return f"{bits}-bit weights (the kernel reads 4-bit codes)"
    if x.dtype not in MAGIC:
        return f"{x.dtype} activations (the kernel multiplies in bf16 or fp16)"
    if scales_dtype != x.dtype:  # the weight is rounded once, in the scales' dtype, as the dequantization does
        return f"{scales_dtype} scales with {x.dtype} activations (the kernel rounds the weight in one dtype)"
    if x.shape[0] > 16:
        return f"{x.shape[0]} rows (the kernel takes up to 16)"
    if k % 64 or group % 64:
        return f"groups of {group} over {k} columns (K steps of 64 must each lie in one group)"
    if k // 8 * n >= 2 ** 31:
        return f"{n}×{k} codes (the kernel indexes them in 32 bits)"
    return None


def mma_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, n: int,
           group: int, *, bn: int, bk: int, split: int, warps: int, workspace, ahead: int = 2,
           x_shared: bool = False, wide: bool = False, staged: bool = False,
           warmup: bool = False) -> torch.Tensor | None:
    """``x @ W.T`` for ``x`` [M ≤ 16, K] (bf16 or fp16) and W packed 4-bit [N, K] in groups of
    ``group`` columns (a power of two ≥ ``bk``; the row's length rounded up to one for a scale a row);
    ``workspace`` (a :class:`~edgeinfer.quant.launching.SplitWorkspace`) holds a split product's partials.
    ``x_shared``: each CTA puts its split's columns of x in shared memory first (``X_SHARED``).
    ``wide``: a lane reads its words of a step side by side, in one load (``WIDE``), and x is read
    (or put in shared memory) in the same permutation of the step's columns.
    ``staged``: with ``x_shared``, every step's words are copied into shared memory too, all at once
    (``STAGED``; the splits must take the same number of steps); where x is not 16-byte aligned
    (no ``x_shared``), the kernel runs as without it.
    ``warmup``: compile the kernel, run nothing, return None (``kernels.compile_ahead``)."""
    m, k = x.shape
    if group % bk or k % bk or bk % 64 or bn % 64:
        raise ValueError(f"K steps of {bk} must divide the row ({k}) and lie in one group ({group}); "
                         f"steps and tiles are multiples of 64 (got {bk}, {bn})")
    x = x.contiguous()
    # x's copies into shared memory are 16 bytes each (cp.async): from a 16-byte aligned x only
    x_shared = x_shared and x.data_ptr() % 16 == 0
    staged = staged and x_shared
    steps = triton.cdiv(k, bk)
    if staged and steps % split:
        raise ValueError(f"staged steps: {steps} steps of {bk} columns do not split {split} ways evenly")
    per_split = triton.cdiv(steps, split) * bk
    splits = triton.cdiv(k, per_split)
    tiles = triton.cdiv(n, bn)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts, arrivals = workspace.take(splits * m * n, tiles) if splits > 1 else (y, y)
    args = (x, codes, scales, zeros if zeros is not None else scales, y, parts, arrivals, m, n, k, scales.shape[1],
            x.stride(0), y.stride(0), per_split, splits)
    given = dict(BN=bn, BM=8 if m <= 8 else 16, BK=bk, GS=group, HAS_Z=zeros is not None, SPLIT_K=splits > 1,
                 WARPS=warps, LW=word_layout(bn, bk, warps, wide), BF16=x.dtype == torch.bfloat16, MAGIC=MAGIC[x.dtype],
                 AHEAD=ahead, X_SHARED=x_shared, X_STEPS=triton.next_power_of_2(per_split // bk) if x_shared else 1,
                 WIDE=wide, STAGED=staged, STEPS=steps // split if staged else 1, num_warps=warps)
    launch(_mma_mm_kernel, (tiles, splits), warmup, *args, **given)
    return None if warmup else y
