"""Triton kernels that read low-bit weights as they are stored and multiply in the activations' dtype.

The weight is a :class:`~edgeinfer.quant.packed.PackedMatrix`: ``codes`` int32 ``[N, K·b/32]``
(the 32/b unsigned b-bit values of each word are consecutive input columns, lowest bits
first), ``scales`` ``[N, groups]``, and ``zeros`` ``[N, groups]`` in the scales' dtype (absent:
the symmetric centre ``2^(b-1)``). Every kernel rebuilds a tile of the weight in registers by
the dequantization rule of :meth:`QuantizedWeight.dequantize`, rounded as it rounds, so a
product equals the product with the dequantized dense weight up to summation order.

* :func:`dequant_tile` — the tile rebuild, shared with the fused batch-1 decode step;
* :func:`packed_mm` — ``x @ W.T`` for up to :data:`MAX_DOT_ROWS` rows: tensor-core tiles of
  dequantized weight, split along K when N alone gives too few programs to fill the GPU;
* :func:`dequantize` — the whole dense weight, for prompts (a GEMM then does the rest).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:  # the import decides whether these kernels exist at all
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = None

MAX_DOT_ROWS = 64  # rows past this take dequantize + GEMM: the tile of weight is then reused enough


def usable(device: torch.device) -> bool:
    """Whether the kernels can run on ``device`` (a GPU, or Triton's CPU interpreter for checks)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def dequant_tile(Q, S, Z, rn, k0, N, K, G, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr,
                     GS: tl.constexpr, HAS_Z: tl.constexpr, dt: tl.constexpr):
        """Columns ``k0 .. k0+BK`` of rows ``rn`` [BN] of the weight, as ``dt`` [BN, BK]; zero where
        a row or column is out of range. ``GS`` is the group size, a power of two, or any power of
        two ≥ K for one group per row; BK and GS divide one another. ``u - z`` is exact in float32
        (and in the scales' dtype, as the reference computes it); the product is rounded to the
        scales' dtype as the reference rounds it."""
        PER: tl.constexpr = 32 // BITS
        words_per_row = (K * BITS) // 32
        rw = k0 // PER + tl.arange(0, BK // PER)
        n_ok = rn < N
        ok = n_ok[:, None] & (rw[None, :] < words_per_row)
        words = tl.load(Q + rn[:, None].to(tl.int64) * words_per_row + rw[None, :], mask=ok, other=0)
        shifts = tl.arange(0, PER) * BITS
        u = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        sdt = S.dtype.element_ty
        if BK <= GS:  # the tile lies in one group
            at = rn * G + k0 // GS
            s = tl.load(S + at, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_Z:
                z = tl.load(Z + at, mask=n_ok, other=0.0).to(tl.float32)
            else:
                z = tl.full([BN], 1 << (BITS - 1), tl.float32)
            u = tl.reshape(u, [BN, BK]).to(tl.float32)
            w = ((u - z[:, None]) * s[:, None]).to(sdt)
        else:
            SG: tl.constexpr = BK // GS
            rg = k0 // GS + tl.arange(0, SG)
            g_ok = n_ok[:, None] & (rg[None, :] < G)
            at = rn[:, None] * G + rg[None, :]
            s = tl.load(S + at, mask=g_ok, other=0.0).to(tl.float32)
            if HAS_Z:
                z = tl.load(Z + at, mask=g_ok, other=0.0).to(tl.float32)
            else:
                z = tl.full([BN, SG], 1 << (BITS - 1), tl.float32)
            u = tl.reshape(u, [BN, SG, GS]).to(tl.float32)
            w = ((u - z[:, :, None]) * s[:, :, None]).to(sdt)
            w = tl.reshape(w, [BN, BK])
        return w.to(dt)

    @triton.jit
    def _packed_mm_kernel(X, Q, S, Z, Y, M, N, K, G, stride_x, stride_y, split_stride,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                          BITS: tl.constexpr, GS: tl.constexpr, HAS_Z: tl.constexpr, IEEE: tl.constexpr):
        """Y[split, m, n] = sum over this split's K range of X[m, k] * W[n, k] (fp32 when split)."""
        dt = X.dtype.element_ty
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        per_split = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
        start = split * per_split
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(start, tl.minimum(start + per_split, K), BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            w = dequant_tile(Q, S, Z, rn, k0, N, K, G, BN, BK, BITS, GS, HAS_Z, dt)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        out = Y + split * split_stride + rm[:, None] * stride_y + rn[None, :]
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)
        else:
            tl.store(out, acc, mask=ok)

    @triton.jit
    def _dequantize_kernel(Q, S, Z, W, N, K, G, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr,
                           GS: tl.constexpr, HAS_Z: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        k0 = tl.program_id(1) * BK
        rk = k0 + tl.arange(0, BK)
        w = dequant_tile(Q, S, Z, rn, k0, N, K, G, BN, BK, BITS, GS, HAS_Z, W.dtype.element_ty)
        tl.store(W + rn[:, None].to(tl.int64) * K + rk[None, :], w, mask=(rn[:, None] < N) & (rk[None, :] < K))


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """What the kernels need to know of a packed weight besides its tensors."""

    n: int
    k: int
    bits: int
    groups: int
    group_constexpr: int  # the group size as the kernels read it (a power of two ≥ K for one group)


@dataclass(frozen=True, slots=True)
class MmConfig:
    bn: int
    bk: int
    split: int
    warps: int = 4
    stages: int = 3


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile_k(layout: PackedLayout, want: int) -> int:
    """A K tile that fits the groups: ``want`` unless the group is smaller and not a divisor."""
    return max(32, min(want, _pow2(layout.k)))


def mm_config(layout: PackedLayout, rows: int, device: torch.device) -> MmConfig:
    """Tiles for ``rows`` rows: narrow N tiles, and K split until there are about two programs
    per multiprocessor (a decode product has few outputs and a long K)."""
    bn = 32 if layout.n >= 4096 else 16
    bk = _tile_k(layout, 128)
    programs = triton.cdiv(layout.n, bn) * triton.cdiv(rows, max(16, _pow2(rows)))
    split = 1
    while programs * split < 2 * _sm_count(device) and layout.k // (bk * split * 2) >= 2:
        split *= 2
    return MmConfig(bn, bk, split)


def packed_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              layout: PackedLayout, config: MmConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` [M, K] with M ≤ :data:`MAX_DOT_ROWS`, ``W`` the packed [N, K] weight."""
    m = x.shape[0]
    if m > MAX_DOT_ROWS:
        raise ValueError(f"packed_mm takes at most {MAX_DOT_ROWS} rows, got {m}: dequantize and use a GEMM")
    x = x.contiguous()
    cfg = config or mm_config(layout, m, x.device)
    bm = max(16, _pow2(m))
    grid = (triton.cdiv(layout.n, cfg.bn), triton.cdiv(m, bm), cfg.split)
    if cfg.split == 1:
        y = torch.empty(m, layout.n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(cfg.split, m, layout.n, dtype=torch.float32, device=x.device)
    _packed_mm_kernel[grid](
        x, codes, scales, zeros if zeros is not None else scales, y, m, layout.n, layout.k, layout.groups,
        x.stride(0), layout.n, m * layout.n,
        BM=bm, BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split, BITS=layout.bits, GS=layout.group_constexpr,
        HAS_Z=zeros is not None, IEEE=x.dtype == torch.float32, num_warps=cfg.warps, num_stages=cfg.stages)
    return y if cfg.split == 1 else y.sum(0).to(x.dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, layout: PackedLayout,
               dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype``."""
    w = torch.empty(layout.n, layout.k, dtype=dtype, device=codes.device)
    bn, bk = 32, _tile_k(layout, 128)
    _dequantize_kernel[(triton.cdiv(layout.n, bn), triton.cdiv(layout.k, bk))](
        codes, scales, zeros if zeros is not None else scales, w, layout.n, layout.k, layout.groups,
        BN=bn, BK=bk, BITS=layout.bits, GS=layout.group_constexpr, HAS_Z=zeros is not None, num_warps=4)
    return w
