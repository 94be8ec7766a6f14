"""The batch-1 4-bit product with a program's words waiting in shared memory: :func:`staged_gemv`.

Right on an H200 and faster alone for gate|up and ``down`` there. In an H200's step the tuner
kept gate|up's staged tile and 4-bit batch-1 decode ran 1.02× faster (a reading); in an H100's
step its descent took the staged tiles out again. Traced in an H100's chain of a layer's
products, a program's copies, issued before its wait, held up the kernel before it, and a one-warp
gate|up tile's programs did not all fit on the GPU at once (docs/results/probes/h100-chain-trace); its own
carveout at all of shared memory did not change that (docs/results/probes/h200-chain-carveout-late).
The load-time tuner times its tiles unless ``EDGEINFER_STAGED_PRODUCTS=0`` (:func:`enabled`); they
are checked against torch before they are timed, as every tile is (``triton_decode.right_tiles``),
and the step keeps one only where it makes the whole step faster.

Under Nsight Compute the decode step's :func:`~edgeinfer.backends.torch.triton_decode.packed_gemv`
was bound neither by bytes nor by issue (docs/gpu-kernels.md): the whole grid is resident at
once, and each SM's programs ask for a step's words, wait, multiply and ask again together, so
a product of S steps waits S memory latencies. Words held in registers cannot both be all in
flight and be multiplied as they arrive. This kernel (Gluon, Triton's explicit layouts) asks for
them differently:

* A program of ``16·warps`` rows issues every 16-byte ``cp.async`` of its share of the words
  first, one commit group a chunk of 128 columns, before it waits for the kernels before it
  (the words are not theirs to write). The copies hold no register, so a whole wave's bytes are
  in flight at once, as many as shared memory holds.
* Then x's columns of the split, all asked for at once with the row's RMSNorm sums and RMSNorm'd
  as the eager layer rounds where the product fuses it, go to shared memory once, a buffer a
  chunk (one buffer would put a barrier between the chunks' stores); chunk i waits only for the
  copies up to its own (``cp.async.wait_group``) and multiplies while the later chunks are still
  arriving. Taken apart on an H100, a program's fixed work (this prologue, the waits and the
  epilogue) was half its time before x was asked for at once (docs/results/probes/h100-staged-x-once).
* The arithmetic is on the tensor cores (``mma.sync`` m16n8k16, Ampere's, so Orin's sm_87 runs
  it too): a lane's four words of a chunk side by side are taken apart into 16-bit ``2^m + q``
  pairs already in the A operand's registers (:func:`a_operand`), x is the B operand in the same
  permutation of the chunk's columns (:func:`b_operand`), and a second MMA of the constant
  ``-(2^m + z)`` takes off the bias and the zero point (with zero points, ``(2^m + z)·Σx``
  from an MMA of ones). The chunk's scale multiplies its float32 sums.
* K is split where N alone gives too few programs; each split writes its partial sums and the
  last to arrive adds them in split order (the same bits on every run). With ``glu`` each 16
  rows are 8 outputs' gate rows and then their up rows, so a lane holds an output's gate and up
  sums and writes SiLU(gate)·up.

:func:`staged_mm` runs the same kernel for 2 to 16 rows of x, with the same fusions, each row its
own: x's rows are the B operand's 8 columns (two MMAs for 16 rows), so a chunk's words are taken
apart once for all rows.
On an H100 it took 0.64–0.76× the time of ``kernels.packed_mm``'s tiles for Qwen2-VL-2B's
products at 4 to 16 rows, and batch-16 4-bit decode ran 1.03× faster with it
(docs/results/probes/h100-staged-rows). ``packed_mm``'s tuner times its tiles for 2 to 16 rows
(``kernels.staged_rows_candidates``) unless ``EDGEINFER_STAGED_ROWS=0``; the decode step's few-row
layers run them fused (``triton_decode.FusedDecode.row_tiles``): batch-16 4-bit decode 10,078 tok/s
against 7,739 unfused on an H100 (docs/results/probes/h100-fused-rows).

Scope: 4-bit codes, bf16 or fp16 activations with scales (and zero points) of the same dtype,
groups of a multiple of 128 columns (or one a row), K a multiple of 128 and rows a multiple of
the tile's; :func:`unfit` says why a product or tile falls outside, and ``packed_gemv`` serves it.
8-bit codes were tried on this kernel (each byte as two 4-bit halves, ``ee06dfb``): right, and slower
than ``packed_gemv`` and ``packed_mm`` on an H100 at one row and at 16
(docs/results/probes/h100-w8-staged), so they were taken out again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.device import cuda_capability
from edgeinfer.quant.launching import PackedWeight, SplitWorkspace, launch, launch_options, pow2, staged_enabled

try:  # the import decides whether this kernel exists at all
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton; older Triton without Gluon
    gluon = None

CHUNK = 128  # columns a commit group and a step of MMAs take: 16 words a row
MAX_CHUNKS = 16  # a program's chunks (each one unrolled, with its own buffer and wait)
MAX_SHARED = 64 * 1024  # a program's words and x in shared memory
WARPS = (1, 2, 4)  # a tile is 16 rows a warp
SPLITS_A_TILE = 3  # splits tried for each tile: the fewest that fit
MIN_CAPABILITY = (8, 0)  # cp.async, mma.sync m16n8k16 with bf16


@dataclass(frozen=True)
class StagedGemvConfig:
    """A tile of :func:`staged_gemv`: ``16·warps`` rows, K split ``split`` ways; ``early``: the chunks
    whose copies go out before x is read (None: all of them; the rest follow x's loads, so that x,
    which the kernel before this one wrote, does not queue behind a whole program's copies)."""

    warps: int
    split: int = 1
    early: int | None = None


def enabled() -> bool:
    """Whether the tuner times this kernel's tiles (unless ``EDGEINFER_STAGED_PRODUCTS=0``)."""
    return staged_enabled()


def unavailable(device: torch.device) -> str | None:
    """None where this kernel can run on ``device``, else why not."""
    if gluon is None:
        return "Triton's Gluon is not installed"
    if device.type != "cuda":
        return "not a CUDA device"
    if cuda_capability(device) < MIN_CAPABILITY:
        return "cp.async and the bf16 mma need sm_80 or later"
    return None


def shared_bytes(k: int, warps: int, split: int, itemsize: int = 2) -> int:
    """A program's shared memory at one row: its words (``16·warps`` rows by its chunks) and x's chunks."""
    chunks = k // CHUNK // split
    return chunks * 16 * warps * CHUNK // 2 + chunks * CHUNK * itemsize


def unfit(w: PackedWeight, dtype: torch.dtype, glu: bool, config: StagedGemvConfig) -> str | None:
    """None where ``config`` can multiply ``w`` for ``dtype`` activations (``glu``: rows gate | up),
    else why not."""
    layout = w.layout
    n, k = layout.n, layout.k
    if layout.bits != 4:
        return f"{layout.bits}-bit codes (the kernel reads 4-bit codes)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} activations (the kernel multiplies in bf16 or fp16)"
    if w.scales.dtype != dtype or (w.zeros is not None and w.zeros.dtype != dtype):
        return f"{w.scales.dtype} scales with {dtype} activations (the kernel takes them in one dtype)"
    if k % CHUNK or layout.group_constexpr % CHUNK:
        return f"groups of {layout.group_constexpr} over {k} columns (chunks of {CHUNK} must each lie in one group)"
    if not w.codes.is_contiguous() or w.codes.data_ptr() % 16:
        return "codes not contiguous and 16-byte aligned (the copies are 16 bytes)"
    chunks = k // CHUNK
    if config.split < 1 or chunks % config.split:
        return f"{chunks} chunks of {CHUNK} columns do not split {config.split} ways"
    if chunks // config.split > MAX_CHUNKS:
        return f"{chunks // config.split} chunks a program (at most {MAX_CHUNKS})"
    if config.early is not None and not 1 <= config.early <= chunks // config.split:
        return f"{config.early} chunks copied early of {chunks // config.split} a program"
    rows = 16 * config.warps
    if glu and (n % 2 or (n // 2) % (rows // 2)):
        return f"{n // 2} outputs in tiles of {rows // 2} (glu)"
    if not glu and n % rows:
        return f"{n} rows in tiles of {rows}"
    need = shared_bytes(k, config.warps, config.split, dtype.itemsize)
    if need > MAX_SHARED:
        return f"{need} bytes of shared memory a program (at most {MAX_SHARED})"
    return None


def tiles_that_fit(w: PackedWeight, dtype: torch.dtype, glu: bool) -> list[StagedGemvConfig]:
    """For each warp count, the :data:`SPLITS_A_TILE` fewest splits that fit ``w`` (:func:`unfit`) with at
    least two chunks a program."""
    chunks = w.layout.k // CHUNK
    tiles = []
    for warps in WARPS:
        fits = [StagedGemvConfig(warps, s) for s in range(1, chunks // 2 + 1)
                if chunks % s == 0 and unfit(w, dtype, glu, StagedGemvConfig(warps, s)) is None]
        tiles += fits[:SPLITS_A_TILE]
    return tiles


def candidates(w: PackedWeight, dtype: torch.dtype, glu: bool) -> list[StagedGemvConfig]:
    """The tiles the tuner times for ``w`` at batch 1: none unless :func:`enabled` and the device can
    run the kernel; else :func:`tiles_that_fit`."""
    if not enabled() or unavailable(w.codes.device) is not None:
        return []
    return tiles_that_fit(w, dtype, glu)


def staged_gemv(x: torch.Tensor, w: PackedWeight, config: StagedGemvConfig, *, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                glu: bool = False, out: torch.Tensor | None = None, workspace: SplitWorkspace | None = None,
                warmup: bool = False) -> torch.Tensor | None:
    """``f(x) @ W.T (+ bias) (+ residual)`` for one row ``x`` [1, K] and a packed 4-bit ``W``, as
    ``triton_decode.packed_gemv`` gives it (``f`` RMSNorm with ``norm_weight``; ``glu``: W's rows
    gate | up, SiLU(gate)·up of N / 2 outputs). Raises :class:`CannotTake` where :func:`unfit` names a
    reason.
    ``warmup``: compile the kernel, run nothing, return None (``kernels.compile_ahead``)."""
    if x.shape[0] != 1:
        raise ValueError(f"staged_gemv reads one row, got {x.shape[0]}")
    if glu and residual is not None:
        raise ValueError("glu writes SiLU(gate)·up and takes no residual")
    n = w.layout.n
    y = out if out is not None else torch.empty(1, n // 2 if glu else n, dtype=x.dtype, device=x.device)
    _launch("staged_gemv", x, w, config, y, workspace, warmup, bias=bias, residual=residual,
            norm_weight=norm_weight, eps=eps, glu=glu)
    return None if warmup else y


MAX_ROWS = 16  # rows of x staged_mm takes: two MMAs of 8 columns a chunk


class CannotTake(ValueError):
    """The kernel cannot take this product on this device: :func:`unavailable` or :func:`unfit` named
    why."""


def staged_mm(x: torch.Tensor, w: PackedWeight, config: StagedGemvConfig, *, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              glu: bool = False, out: torch.Tensor | None = None, workspace: SplitWorkspace | None = None,
              warmup: bool = False) -> torch.Tensor | None:
    """``f(x) @ W.T (+ bias) (+ residual)`` for 2 to :data:`MAX_ROWS` rows ``x`` [M, K] and a packed 4-bit
    ``W``, what :func:`staged_gemv` fuses fused the same way for every row (``residual`` [M, N]): the
    words staged as :func:`staged_gemv` stages them, taken apart once a chunk for all rows (x's rows
    are the MMA's B columns, 8 an MMA). Raises :class:`CannotTake` where :func:`unfit` names a reason.
    ``warmup`` as in :func:`staged_gemv`."""
    m = x.shape[0]
    if not 1 < m <= MAX_ROWS:
        raise ValueError(f"staged_mm reads 2 to {MAX_ROWS} rows, got {m}")
    if glu and residual is not None:
        raise ValueError("glu writes SiLU(gate)·up and takes no residual")
    n = w.layout.n
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"the residual must be a contiguous [{m}, {n}], got {tuple(residual.shape)} "
                         f"with strides {residual.stride()}")
    y = out if out is not None else torch.empty(m, n // 2 if glu else n, dtype=x.dtype, device=x.device)
    _launch("staged_mm", x, w, config, y, workspace, warmup, bias=bias, residual=residual,
            norm_weight=norm_weight, eps=eps, glu=glu)
    return None if warmup else y


def _launch(caller: str, x: torch.Tensor, w: PackedWeight, config: StagedGemvConfig, y: torch.Tensor,
            workspace: SplitWorkspace | None, warmup: bool, *, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            glu: bool = False) -> None:
    """:func:`_staged_gemv_kernel` on ``x``'s rows, with what the step fuses, into ``y``, once
    :func:`unavailable` and :func:`unfit` have found nothing against it (else
    :class:`CannotTake`, ``caller`` named). A compile alone (``warmup``) may target a GPU this machine does
    not have: it needs Gluon only."""
    reason = unavailable(x.device) if not warmup else ("Triton's Gluon is not installed" if gluon is None else None)
    reason = reason or unfit(w, x.dtype, glu, config)
    if reason is not None:
        raise CannotTake(f"{caller} cannot take this product: {reason}")
    m = x.shape[0]
    layout = w.layout
    n, k = layout.n, layout.k
    chunks = k // CHUNK // config.split
    tiles = n // (16 * config.warps)
    x = x.contiguous()
    x_rows = 1 if m == 1 else 8 if m <= 8 else 16  # x's rows as the MMAs take them: partial sums a weight row
    parts, arrivals = (workspace or SplitWorkspace(x.device)).take(config.split * x_rows * n, tiles) \
        if config.split > 1 else (y, y)
    codes = w.codes
    launch(_staged_gemv_kernel, (tiles, config.split), warmup,
           x, codes, w.scales, w.zeros if w.zeros is not None else w.scales,
           bias if bias is not None else codes, residual if residual is not None else codes,
           norm_weight if norm_weight is not None else codes, y, parts, arrivals, n, k, k // 8, layout.groups, eps, m,
           GPS=chunks, NW=config.warps, SPLIT=config.split,
           EARLY=chunks if config.early is None else config.early, GS=layout.group_constexpr,
           XB=min(pow2(k), 2048), PROLOGUE=norm_weight is not None, HAS_BIAS=bias is not None,
           HAS_RES=residual is not None, HAS_Z=w.zeros is not None, GLU=glu, BF16=x.dtype == torch.bfloat16,
           MP=x_rows, KC=k // CHUNK if m > 1 and norm_weight is not None else 0, **launch_options(x.device),
           num_warps=config.warps)


if gluon is not None:
    # a CTA's barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` in 3.9; a copy into shared memory:
    # ``async_copy_global_to_shared`` in 3.6, ``async_load`` in 3.9 (as edgeinfer.quant.tensor_core)
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.constexpr_function
    def mma_layout(nw):
        """``mma.sync`` m16n8k16's accumulator, warps along the rows: 16 rows a warp."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[nw, 1], instr_shape=[16, 8])

    @gluon.constexpr_function
    def word_layout(nw):
        """[16·nw rows, a chunk's 16 words]: lane (g, c) holds words 4c .. 4c+3 of rows g and g + 8."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16 << i, 0] for i in range(nw.bit_length() - 1)], block_bases=[], shape=[16 * nw, 16])

    @gluon.constexpr_function
    def x_layout(nw):
        """A chunk's 128 columns of x as stored: lane c holds columns 32c .. 32c+31 (every row lane alike).
        (Stored in the operand's order instead and read in its layout, x took more instructions a chunk.)"""
        return gl.DistributedLinearLayout(
            reg_bases=[[1], [2], [4], [8], [16]], lane_bases=[[32], [64], [0], [0], [0]],
            warp_bases=[[0] for _ in range(nw.bit_length() - 1)], block_bases=[], shape=[128])

    @gluon.constexpr_function
    def _plain(rank):
        """Shared memory as the values lie, row after row (no swizzle), for views of ``rank`` dimensions
        (a buffer of rank + 1 is indexed along its first)."""
        return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=list(range(rank - 1, -1, -1)))

    @gluon.constexpr_function
    def _pair_asm(j, bf16):
        """Codes j and j + 4 of a word into the mantissa of 2^m, two 16-bit floats in one register
        (m = 7 for bf16, 10 for fp16)."""
        magic = "0x43004300" if bf16 else "0x64006400"
        if j == 0:
            return f"lop3.b32 $0, $1, 0x000f000f, {magic}, 0xea;"
        return "{ .reg .b32 u; shr.u32 u, $1, %d; lop3.b32 $0, u, 0x000f000f, %s, 0xea; }" % (4 * j, magic)

    @gluon.jit
    def _pair(words2, J: gl.constexpr, BF16: gl.constexpr):
        """Codes j and j + 4 of each word as 16-bit 2^m + q in one register (``words2`` holds each
        word twice: the two elements of a packed pair)."""
        if BF16:
            pair = gl.inline_asm_elementwise(_pair_asm(J, True), "=r,r,r", [words2], dtype=gl.bfloat16, is_pure=True,
                                             pack=2)
        else:
            pair = gl.inline_asm_elementwise(_pair_asm(J, False), "=r,r,r", [words2], dtype=gl.float16, is_pure=True,
                                             pack=2)
        return pair

    @gluon.jit
    def a_operand(words, A: gl.constexpr, BN: gl.constexpr, BF16: gl.constexpr = True):
        """A chunk's words [BN, 16] as the MMA's A operand [BN, 128] of 2^m + q: column 32b + 8c + 2j + h
        holds code j + 4h of word 4c + b."""
        w2 = gl.join(words, words)
        r = gl.join(gl.join(_pair(w2, 0, BF16), _pair(w2, 1, BF16)),
                    gl.join(_pair(w2, 2, BF16), _pair(w2, 3, BF16)))  # [BN, 16, h, j0, j1]
        r = gl.reshape(r, [BN, 4, 4, 2, 2, 2])  # word 4c + b
        r = gl.permute(r, [0, 2, 1, 5, 4, 3])  # [BN, b, c, j1, j0, h]
        return gl.convert_layout(gl.reshape(r, [BN, 128]), A, assert_trivial=True)

    @gluon.jit
    def b_operand(x, B: gl.constexpr):
        """A chunk's x [128] (as stored) as the MMA's B operand [128, 8] in the A operand's column order
        (its 8 columns alike)."""
        xr = gl.permute(gl.reshape(x, [4, 4, 2, 4]), [1, 0, 3, 2])  # column 32c + 8b + 4h + j -> [b, c, j, h]
        xr = gl.convert_layout(gl.reshape(xr, [128]), gl.SliceLayout(1, B))
        return gl.broadcast(xr[:, None], gl.full([128, 8], 0.0, x.dtype, B))[0]

    @gluon.jit
    def b_rows(x, B: gl.constexpr):
        """A chunk's x of 8 rows [8, 128] (as stored) as the MMA's B operand [128, 8] in the A operand's
        column order: row r of x is column r."""
        xr = gl.permute(gl.reshape(x, [8, 4, 4, 2, 4]), [0, 2, 1, 4, 3])  # as b_operand, a row at a time
        return gl.convert_layout(gl.permute(gl.reshape(xr, [8, 128]), [1, 0]), B)

    @gluon.jit
    def _chunk_sums(a, less, b, scale, zero, MAGIC: gl.constexpr, HAS_Z: gl.constexpr, mma: gl.constexpr):
        """A chunk's scaled sums [BN, 8] of A (codes as 2^m + q) by B: the bias and the zero point taken
        off by a second MMA (``less``: the constant ``-(2^m + 2^(b-1))``, or -1 for ``-Σx`` with zero
        points), then the chunk's scale."""
        d = mma_v2(a, b, gl.zeros([a.shape[0], 8], gl.float32, mma))
        if HAS_Z:
            minus_sum = mma_v2(less, b, gl.zeros([a.shape[0], 8], gl.float32, mma))
            return scale[:, None] * (d + (MAGIC + zero)[:, None] * minus_sum)
        return scale[:, None] * mma_v2(less, b, d)

    @gluon.jit
    def _store_rows(acc0, acc1, rows, Y, N, M, MP: gl.constexpr, mma: gl.constexpr):
        """Columns of ``acc0`` [BN, 8] as rows 0 .. 7 of Y [M, N] and, where ``MP`` is 16, those of ``acc1``
        as rows 8 .. 15, at weight rows ``rows`` (rows past M left alone)."""
        m = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        at = Y + m[None, :] * N + rows[:, None]
        gl.store(at, acc0.to(Y.dtype.element_ty), mask=(m[None, :] < M) & (rows[:, None] >= 0))
        if MP == 16:
            gl.store(at + 8 * N, acc1.to(Y.dtype.element_ty), mask=(m[None, :] + 8 < M) & (rows[:, None] >= 0))

    @gluon.jit
    def _finish_rows(acc, first, rows, bias, RES, Y, N, M, BN: gl.constexpr, GLU: gl.constexpr,
                     HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, mma: gl.constexpr):
        """The sums ``acc`` [BN, 8] of weight rows ``rows`` for x's rows ``first`` .. ``first`` + 7, written
        to Y as :func:`_finish` writes one row's (rows past M left alone): (+ bias), then the residual
        (RES [M, N]), or with ``GLU`` SiLU(gate)·up into Y [M, N / 2]."""
        dt: gl.constexpr = Y.dtype.element_ty
        m = first + gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        v = acc.to(dt)
        if HAS_BIAS:
            v = (v.to(gl.float32) + bias[:, None]).to(dt)
        if GLU:  # [BN, 8] -> [BN/16, 8, 8, 2]: an output's gate and up sums side by side in one lane
            gate, up = gl.split(gl.permute(gl.reshape(v.to(gl.float32), [BN // 16, 2, 8, 8]), [0, 2, 3, 1]))
            at = m[None, :] * (N // 2) + rows[:, None]  # the gate rows' outputs, each under N / 2
            outs, _ = gl.split(gl.permute(gl.reshape(at, [BN // 16, 2, 8, 8]), [0, 2, 3, 1]))
            act = (gate * (1 / (1 + gl.exp(-gate)))).to(dt).to(gl.float32)  # tl.sigmoid's own formula
            gl.store(Y + outs, (act * up).to(dt), mask=outs < M * (N // 2))  # x's rows under M
        else:
            at = m[None, :] * N + rows[:, None]
            ok = (m[None, :] < M) & (rows[:, None] >= 0)
            if HAS_RES:
                v = (v.to(gl.float32) + gl.load(RES + at, mask=ok, other=0.0).to(gl.float32)).to(dt)
            gl.store(Y + at, v, mask=ok)

    @gluon.jit
    def _weight_rows(tile, r, N, BN: gl.constexpr, GLU: gl.constexpr):
        """The weight rows of a tile's rows ``r``: ``tile·BN + r``; with ``GLU`` each 16 rows are the
        gate rows of 8 outputs and then their up rows (rows g and g + 8 are one lane's)."""
        if GLU:
            j = tile * (BN // 2) + r // 16 * 8 + r % 8
            return j + r % 16 // 8 * (N // 2)
        return tile * BN + r

    @gluon.jit
    def _finish(y, rows, bias, RES, Y, N, BN: gl.constexpr, GLU: gl.constexpr, HAS_BIAS: gl.constexpr,
                HAS_RES: gl.constexpr):
        """The sums ``y`` of weight rows ``rows`` [BN] written as ``triton_decode``'s epilogues write
        them, rounded where the eager layer rounds: (+ bias), then the residual, or with ``GLU``
        SiLU(gate)·up at the gate rows' outputs."""
        dt: gl.constexpr = Y.dtype.element_ty
        v = y.to(dt)
        if HAS_BIAS:
            v = (v.to(gl.float32) + bias).to(dt)
        if GLU:  # [BN] -> [BN/16, 8, 2]: an output's gate and up sums side by side in one lane
            gate, up = gl.split(gl.permute(gl.reshape(v.to(gl.float32), [BN // 16, 2, 8]), [0, 2, 1]))
            outs, _ = gl.split(gl.permute(gl.reshape(rows, [BN // 16, 2, 8]), [0, 2, 1]))
            act = (gate * (1 / (1 + gl.exp(-gate)))).to(dt).to(gl.float32)  # tl.sigmoid's own formula
            gl.store(Y + outs, (act * up).to(dt))
        else:
            if HAS_RES:
                v = (v.to(gl.float32) + gl.load(RES + rows).to(gl.float32)).to(dt)
            gl.store(Y + rows, v)

    @gluon.jit
    def _rows_rstd(X, K, M, eps, KC: gl.constexpr, MP: gl.constexpr, lx: gl.constexpr):
        """1 / RMS of x's rows 0 .. 7 and 8 .. 15 (each [8], in ``lx``'s rows): every chunk's loads asked for
        at once (unrolled over ``KC`` chunks of 128 columns), in float32 as the eager norm sums."""
        xm = gl.arange(0, 8, layout=gl.SliceLayout(1, lx))
        xk = gl.arange(0, 128, layout=gl.SliceLayout(0, lx))
        at = X + xm[:, None] * K + xk[None, :]
        lo_ok = (xm[:, None] < M) & (xk[None, :] < 128)
        hi_ok = (xm[:, None] + 8 < M) & (xk[None, :] < 128)
        ss_lo = gl.zeros([8, 128], gl.float32, lx)
        ss_hi = gl.zeros([8, 128], gl.float32, lx)
        for i in gl.static_range(KC):
            v = gl.load(at + i * 128, mask=lo_ok, other=0.0).to(gl.float32)
            ss_lo += v * v
            if MP == 16:
                v = gl.load(at + 8 * K + i * 128, mask=hi_ok, other=0.0).to(gl.float32)
                ss_hi += v * v
        rstd_lo = 1.0 / gl.sqrt(gl.sum(ss_lo, axis=1) / K + eps)
        rstd_hi = 1.0 / gl.sqrt(gl.sum(ss_hi, axis=1) / K + eps)
        return rstd_lo, rstd_hi

    @gluon.jit
    def _normed(x, rstd, w, dt: gl.constexpr):
        """RMSNorm of a chunk of rows ``x`` [8, 128] as the eager layer rounds it (``w`` the chunk's weight)."""
        xn = (x.to(gl.float32) * rstd[:, None]).to(dt).to(gl.float32)
        return (xn * w.to(gl.float32)[None, :]).to(dt)

    @gluon.jit
    def _several_rows(X, NORM_W, RES, w_smem, lw: gl.constexpr, la: gl.constexpr, lb: gl.constexpr, less, scales,
                      zeros, bias, rows, Y, PARTS, ARRIVALS, tile, split, N, K, M, c0, eps, GPS: gl.constexpr,
                      NW: gl.constexpr, SPLIT: gl.constexpr, MP: gl.constexpr, KC: gl.constexpr, MAGIC: gl.constexpr,
                      PROLOGUE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, HAS_Z: gl.constexpr,
                      GLU: gl.constexpr, BF16: gl.constexpr, mma: gl.constexpr):
        """The chunks' MMAs and the rows' outputs of :func:`_staged_gemv_kernel` for M > 1 rows of x (at
        most ``MP``), with what :func:`_one_row` fuses: each chunk of x RMSNorm'd (its rows' RMS first,
        over the whole rows), and the bias, residual or SiLU·up on the way out."""
        BN: gl.constexpr = 16 * NW
        dt: gl.constexpr = Y.dtype.element_ty
        lx: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[NW, 1],
                                            order=[1, 0])
        xm = gl.arange(0, 8, layout=gl.SliceLayout(1, lx))
        xk = gl.arange(0, 128, layout=gl.SliceLayout(0, lx))
        x_at = X + xm[:, None] * K + c0 * 128 + xk[None, :]  # rows 0-7; rows 8-15 at 8·K past them
        lo_ok = (xm[:, None] < M) & (xk[None, :] < 128)
        hi_ok = (xm[:, None] + 8 < M) & (xk[None, :] < 128)
        rstd_lo = gl.full([8], 1.0, gl.float32, gl.SliceLayout(1, lx))
        rstd_hi = rstd_lo
        if PROLOGUE:
            rstd_lo, rstd_hi = _rows_rstd(X, K, M, eps, KC, MP, lx)
        lo_next = gl.load(x_at, mask=lo_ok, other=0.0)
        hi_next = lo_next
        if MP == 16:
            hi_next = gl.load(x_at + 8 * K, mask=hi_ok, other=0.0)
        w_next = xk
        if PROLOGUE:
            w_next = gl.load(NORM_W + c0 * 128 + xk)
        acc0 = gl.zeros([BN, 8], gl.float32, mma)
        acc1 = gl.zeros([BN, 8], gl.float32, mma)
        for i in gl.static_range(GPS):
            lo, hi, nw = lo_next, hi_next, w_next
            if i + 1 < GPS:  # the next chunk's x asked for before this chunk's MMAs
                lo_next = gl.load(x_at + (i + 1) * 128, mask=lo_ok, other=0.0)
                if MP == 16:
                    hi_next = gl.load(x_at + 8 * K + (i + 1) * 128, mask=hi_ok, other=0.0)
                if PROLOGUE:
                    w_next = gl.load(NORM_W + (c0 + i + 1) * 128 + xk)
            if PROLOGUE:
                lo = _normed(lo, rstd_lo, nw, dt)
                if MP == 16:
                    hi = _normed(hi, rstd_hi, nw, dt)
            async_copy.wait_group(GPS - 1 - i)  # this thread's copies up to chunk i have landed
            _cta_barrier()  # and every other thread's
            a = a_operand(w_smem[i].load(lw), la, BN, BF16)
            zero = zeros[i] if HAS_Z else 0.0
            acc0 += _chunk_sums(a, less, b_rows(lo, lb), scales[i], zero, MAGIC, HAS_Z, mma)
            if MP == 16:
                acc1 += _chunk_sums(a, less, b_rows(hi, lb), scales[i], zero, MAGIC, HAS_Z, mma)
        if SPLIT == 1:
            _finish_rows(acc0, 0, rows, bias, RES, Y, N, M, BN, GLU, HAS_BIAS, HAS_RES, mma)
            if MP == 16:
                _finish_rows(acc1, 8, rows, bias, RES, Y, N, M, BN, GLU, HAS_BIAS, HAS_RES, mma)
        else:  # partials at [split, row of x, weight row]; the last split to arrive adds them in split order
            _store_rows(acc0, acc1, rows, PARTS + split * MP * N, N, MP, MP, mma)
            _cta_barrier()  # every thread's partials are written before the count says so
            if gl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel") == SPLIT - 1:
                m8 = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
                total0 = gl.zeros_like(acc0)
                total1 = gl.zeros_like(acc1)
                for j in gl.static_range(SPLIT):
                    first = PARTS + (j * MP + m8)[None, :] * N + rows[:, None]
                    total0 += gl.load(first, cache_modifier=".cg")
                    if MP == 16:
                        total1 += gl.load(first + 8 * N, cache_modifier=".cg")
                _finish_rows(total0, 0, rows, bias, RES, Y, N, M, BN, GLU, HAS_BIAS, HAS_RES, mma)
                if MP == 16:
                    _finish_rows(total1, 8, rows, bias, RES, Y, N, M, BN, GLU, HAS_BIAS, HAS_RES, mma)
                gl.atomic_xchg(ARRIVALS + tile, 0)

    @gluon.jit
    def _staged_gemv_kernel(X, W, S, Z, BIAS, RES, NORM_W, Y, PARTS, ARRIVALS, N, K, KW, G, eps, M,
                            GPS: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr,
                            EARLY: gl.constexpr, GS: gl.constexpr, XB: gl.constexpr, PROLOGUE: gl.constexpr, HAS_BIAS: gl.constexpr,
                            HAS_RES: gl.constexpr, HAS_Z: gl.constexpr, GLU: gl.constexpr, BF16: gl.constexpr,
                            PDL: gl.constexpr, MP: gl.constexpr = 1, KC: gl.constexpr = 0):
        """Y = f(X)·W (+ bias) (+ residual) for 16·NW weight rows (:func:`_weight_rows`) over chunks
        [split·GPS, (split + 1)·GPS) of 128 columns; ``KW`` = K / 8 words a row (an argument of its
        own, so that a launch sees it a multiple of 16 where it is: a lane's four words are then one
        16-byte copy); scales and zero points ``[N, G]``, groups of ``GS`` columns; the first ``EARLY`` chunks'
        copies go out before x is read, the others after x's loads. At one row every chunk's x (and
        the norm's weight) is asked for before the row's RMSNorm sums, so that one wait serves them
        all, spread over the program's threads rather than all of it in every warp.

        ``MP`` 8 or 16 (:func:`staged_mm`): X is [M, K], 2 to ``MP`` rows, Y [M, N] (or [M, N / 2] with
        ``GLU``) and RES [M, N], with the same fusions, each row its own (``KC``: K / 128, the chunks
        of each row's RMSNorm sums, unrolled): the rows are the B operand's columns, 8 an MMA, so
        a chunk's words are taken apart once for all of them; each chunk's x comes from memory (L2:
        every program reads it) one chunk ahead of its MMAs, not through shared memory; partial sums
        at [split, row of x, weight row]. M is an argument, so that every count of rows up to ``MP``
        runs one compiled kernel (each batch size the decode captures would otherwise be a compile)."""
        BN: gl.constexpr = 16 * NW
        MAGIC: gl.constexpr = 128.0 if BF16 else 1024.0
        dt: gl.constexpr = Y.dtype.element_ty
        mma: gl.constexpr = mma_layout(NW)
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        lw: gl.constexpr = word_layout(NW)
        lv: gl.constexpr = gl.BlockedLayout(size_per_thread=[max(2, 4 // NW)], threads_per_warp=[32], warps_per_cta=[NW],
                                            order=[0])  # x spread over the warps, 4 bytes a load or more
        tile = gl.program_id(0)
        split = gl.program_id(1)
        c0 = split * GPS
        # every chunk's words, a buffer and a commit group each (shared memory's shapes are powers of
        # two; GPS need not be), before the wait: the kernels before this one do not write them
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, lw))
        wc = gl.arange(0, 16, layout=gl.SliceLayout(0, lw))
        words_at = W + _weight_rows(tile, r, N, BN, GLU).to(gl.int64)[:, None] * KW + (c0 * 16 + wc)[None, :]
        w_smem = ()
        for i in gl.static_range(GPS):
            w_smem = w_smem + (gl.allocate_shared_memory(gl.int32, [BN, 16], _plain(2)),)
            if i < EARLY:
                _async_load(w_smem[i], words_at + i * 16)
                async_copy.commit_group()
        rows = _weight_rows(tile, gl.arange(0, BN, layout=gl.SliceLayout(1, mma)), N, BN, GLU)
        scales = ()
        zeros = ()
        for i in gl.static_range(GPS):
            g = (c0 + i) * 128 // GS
            scales = scales + (gl.load(S + rows * G + g).to(gl.float32),)
            if HAS_Z:
                zeros = zeros + (gl.load(Z + rows * G + g).to(gl.float32),)
        bias = 0.0
        if HAS_BIAS:
            bias = gl.load(BIAS + rows).to(gl.float32)
        if PDL:  # x and the residual are the kernels before this one's: wait for them, let the next launch
            gdc_wait()
            gdc_launch_dependents()
        xs = ()  # one row: the split's chunks of x (and of the norm's weight), asked for with the row's sums
        norms = ()
        if MP == 1:
            xk = gl.arange(0, 128, layout=lv)
            for i in gl.static_range(GPS):
                xs = xs + (gl.load(X + (c0 + i) * 128 + xk),)
                if PROLOGUE:
                    norms = norms + (gl.load(NORM_W + (c0 + i) * 128 + xk),)
        rstd = 1.0
        if PROLOGUE and MP == 1:  # RMSNorm over the whole row, whatever columns this program reads
            lr: gl.constexpr = gl.BlockedLayout(size_per_thread=[8], threads_per_warp=[32], warps_per_cta=[NW],
                                                order=[0])
            ss = gl.zeros([XB], gl.float32, lr)
            for k0 in range(0, K, XB):
                rk = k0 + gl.arange(0, XB, layout=lr)
                xv = gl.load(X + rk, mask=rk < K, other=0.0).to(gl.float32)
                ss += xv * xv
            rstd = 1.0 / gl.sqrt(gl.sum(ss, axis=0) / K + eps)
        less = gl.full([BN, 128], -(MAGIC + 8.0), dt, la)  # symmetric: 2^m + 2^(b-1) off each code
        if HAS_Z:
            less = gl.full([BN, 128], -1.0, dt, la)  # -Σx, for (2^m + z)·Σx
        if MP > 1:
            _several_rows(X, NORM_W, RES, w_smem, lw, la, lb, less, scales, zeros, bias, rows, Y, PARTS, ARRIVALS, tile,
                          split, N, K, M, c0, eps, GPS, NW, SPLIT, MP, KC, MAGIC, PROLOGUE, HAS_BIAS, HAS_RES, HAS_Z, GLU,
                          BF16, mma)
        else:
            _one_row(xs, norms, BIAS, RES, Y, PARTS, ARRIVALS, w_smem, words_at, lw, la, lb, less, scales, zeros,
                     bias, rows, rstd, tile, split, N, c0, GPS, NW, SPLIT, EARLY, PROLOGUE, HAS_BIAS, HAS_RES, HAS_Z,
                     GLU, BF16, MAGIC, mma)

    @gluon.jit
    def _one_row(xs, norms, BIAS, RES, Y, PARTS, ARRIVALS, w_smem, words_at, lw: gl.constexpr, la: gl.constexpr,
                 lb: gl.constexpr, less, scales, zeros, bias, rows, rstd, tile, split, N, c0,
                 GPS: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr, EARLY: gl.constexpr,
                 PROLOGUE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, HAS_Z: gl.constexpr,
                 GLU: gl.constexpr, BF16: gl.constexpr, MAGIC: gl.constexpr, mma: gl.constexpr):
        """The rest of :func:`_staged_gemv_kernel` for one row of x, whose split's chunks ``xs`` (and the norm's
        weight's, ``norms``) it was given: x through shared memory, the later chunks' copies, the MMAs and the
        row's epilogue."""
        BN: gl.constexpr = 16 * NW
        dt: gl.constexpr = Y.dtype.element_ty
        # f(x) of the split's chunks, rounded as the eager layer rounds, into shared memory once, a buffer a
        # chunk: stores into one buffer would each wait at a barrier for the one before
        x_smem = ()
        for i in gl.static_range(GPS):
            xv = xs[i]
            if PROLOGUE:
                xn = (xv.to(gl.float32) * rstd).to(dt).to(gl.float32)
                xv = (xn * norms[i].to(gl.float32)).to(dt)
            x_smem = x_smem + (gl.allocate_shared_memory(dt, [128], _plain(1)),)
            x_smem[i].store(xv)
        for i in gl.static_range(EARLY, GPS):  # the later chunks' copies, a commit group each, in order
            _async_load(w_smem[i], words_at + i * 16)
            async_copy.commit_group()
        acc = gl.zeros([BN, 8], gl.float32, mma)
        for i in gl.static_range(GPS):
            async_copy.wait_group(GPS - 1 - i)  # this thread's copies up to chunk i have landed
            _cta_barrier()  # and every other thread's, and x in shared memory
            b = b_operand(x_smem[i].load(x_layout(NW)), lb)
            zero = zeros[i] if HAS_Z else 0.0
            acc += _chunk_sums(a_operand(w_smem[i].load(lw), la, BN, BF16), less, b, scales[i], zero, MAGIC, HAS_Z,
                               mma)
        n8 = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        y = gl.sum(gl.where(n8[None, :] == 0, acc, 0.0), axis=1)  # the 8 columns hold the same sums
        if SPLIT == 1:
            _finish(y, rows, bias, RES, Y, N, BN, GLU, HAS_BIAS, HAS_RES)
        else:  # partials at [split, row]; the last split to arrive adds them in split order
            gl.store(PARTS + split * N + rows, y)
            _cta_barrier()  # every thread's partials are written before the count says so
            if gl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel") == SPLIT - 1:
                total = gl.zeros_like(y)
                for j in gl.static_range(SPLIT):
                    total += gl.load(PARTS + j * N + rows, cache_modifier=".cg")
                _finish(total, rows, bias, RES, Y, N, BN, GLU, HAS_BIAS, HAS_RES)
                gl.atomic_xchg(ARRIVALS + tile, 0)
