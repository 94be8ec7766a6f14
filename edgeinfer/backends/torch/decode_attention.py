"""The decode step's attention over the paged pool: one new token a row against its past.

Flash decoding in one Triton kernel (:func:`paged_attention`): a program takes one row, one KV
head and one split of the row's context, and the KV head's group of query heads with it, so the
past is read once a group. RoPE is applied to the query and the new key on the fly (after a
per-head RMSNorm where the model has one, as Qwen3), the past is read where it lies through the
block table, and the new token's K/V are written to the pool (bursts) or returned (single steps).
The last split of a row and KV head to arrive merges the splits' partial results
(:func:`_merge_splits`), so no second kernel, and no launch, comes between the attention and the
product after it. Splits past a row's context return at once: a graph captured for a wide table
costs what each row's own context holds.

It runs at every batch size: between the fused products (:mod:`~edgeinfer.backends.torch.triton_decode`:
at one row, and at 2 to 16 where the staged products take the layer), and between the layer's own
products otherwise.
Every rounding point is the eager attention's, so it gives the eager layer's tokens within the
dtype's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.quant.launching import SplitWorkspace, launch_options, pow2

try:  # the import decides whether this path exists at all
    import triton
    import triton.language as tl

    from edgeinfer.quant.kernels import arrived_last, await_inputs
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = None

if triton is not None:

    @triton.jit
    def _rope(x, partner, sign, c, s, dt: tl.constexpr):
        """x * cos + rotate_half(x) * sin, with ``partner`` = x at the rotated index; rounded as the eager layer."""
        return ((x * c).to(dt).to(tl.float32) + (sign * partner * s).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _head_norm(x, partner, r, w, wp, dt: tl.constexpr):
        """A head's RMSNorm (``r`` = 1 / rms over the head) applied to ``x`` and to its RoPE
        partner, rounded as the eager ``weight * (x * r).to(dtype)``."""
        xn = ((x * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        pn = ((partner * r).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
        return xn, pn

    @triton.jit
    def _past_tile(KP, VP, TABLE, p, end, kvh, rd, d_ok, stride_kb, stride_ks, BS: tl.constexpr, HD: tl.constexpr):
        """K and V of one KV head at positions ``p`` [TILE] of a row's past (``TABLE`` its block
        table), zero from ``end`` on."""
        p_ok = p < end
        block = tl.load(TABLE + p // BS, mask=p_ok, other=0)
        base = block * stride_kb + (p % BS) * stride_ks + kvh * HD
        kv_ok = p_ok[:, None] & d_ok[None, :]
        k = tl.load(KP + base[:, None] + rd[None, :], mask=kv_ok, other=0.0)
        v = tl.load(VP + base[:, None] + rd[None, :], mask=kv_ok, other=0.0)
        return k, v

    @triton.jit
    def _attend(q, k, v, p_ok, m_i, l_i, acc, scale, dt: tl.constexpr, IEEE: tl.constexpr):
        """One step of the online softmax: the group's queries ``q`` [GP, HDP] against a tile's keys
        ``k`` and values ``v`` [TILE, HDP], positions where ``p_ok`` only; the running maximum ``m_i``,
        sum ``l_i`` and output ``acc`` carried over, as returned."""
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(p_ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(dt), v)
        return m_new, l_i, acc

    @triton.jit
    def _attention_kernel(QKV, COS, SIN, KP, VP, TABLES, CTX, VALID, KOUT, VOUT, OPART, MPART, LPART, ARRIVALS,
                          OUT, QW, KW, stride_qkv, stride_cs, stride_tab, stride_kb, stride_ks, stride_out, scale, eps,
                          KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                          HDP: tl.constexpr, BS: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                          SPLITS: tl.constexpr, GM: tl.constexpr, MC: tl.constexpr, WRITE_POOL: tl.constexpr,
                          IEEE: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
        """One (row, KV head, split): the group's query heads against positions
        [split * CHUNK, (split + 1) * CHUNK) of the past, plus the new token where it falls.
        With ``QK_NORM`` each head of q and of the new k is RMSNorm'd (weights ``QW``/``KW``)
        before RoPE, as Qwen3's attention does. A tile of the past is read while the tile before
        it is multiplied, the first before the q|k|v product has finished (``PDL``,
        :func:`await_inputs`: the product writes q, k and v, not the past).

        The grid has a split for every ``CHUNK`` positions of the table; splits past the row's
        context return at once, and the merge reads only the used splits' partials, in a loop that
        runs to the used count (:func:`_merge_splits`).

        Unsplit, the program writes its heads' outputs. Split, each program writes its partial
        output, maximum and sum, and counts itself in ``ARRIVALS`` (one count a row and KV head,
        :func:`arrived_last`); the last of the group's used splits to arrive merges them
        (:func:`_merge_splits`), writes the heads' outputs and sets the count back to zero: no
        second kernel, and no launch between the attention and the product after it."""
        HALF: tl.constexpr = HD // 2
        dt = KP.dtype.element_ty
        m = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(CTX + m).to(tl.int32)
        # The splits that hold a position of the row's past or its new token (at position ctx): the
        # grid is sized by the table's width, the work and the merge by the row's own context.
        used = tl.minimum(ctx // CHUNK + 1, SPLITS)
        if s >= used:
            return
        rg = tl.arange(0, GP)
        rd = tl.arange(0, HDP)
        d_ok = rd < HD
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, ctx)
        rt = tl.arange(0, TILE)
        k, v = _past_tile(KP, VP, TABLES + m * stride_tab, start + rt, end, kvh, rd, d_ok, stride_kb, stride_ks,
                          BS, HD)
        await_inputs(PDL)
        partner = tl.where(rd < HALF, rd + HALF, rd - HALF)
        sign = tl.where(rd < HALF, -1.0, 1.0)
        q_ok = (rg[:, None] < G) & d_ok[None, :]
        heads = kvh * G + rg
        row = QKV + m * stride_qkv
        c = tl.load(COS + m * stride_cs + rd, mask=d_ok, other=0.0).to(tl.float32)
        sn = tl.load(SIN + m * stride_cs + rd, mask=d_ok, other=0.0).to(tl.float32)
        q = tl.load(row + heads[:, None] * HD + rd[None, :], mask=q_ok, other=0.0).to(tl.float32)
        qp = tl.load(row + heads[:, None] * HD + partner[None, :], mask=q_ok, other=0.0).to(tl.float32)
        if QK_NORM:
            rq = 1.0 / tl.sqrt(tl.sum(q * q, axis=1) / HD + eps)
            wq = tl.load(QW + rd, mask=d_ok, other=0.0).to(tl.float32)
            wqp = tl.load(QW + partner, mask=d_ok, other=0.0).to(tl.float32)
            q, qp = _head_norm(q, qp, rq[:, None], wq[None, :], wqp[None, :], dt)
        q = _rope(q, qp, sign[None, :], c[None, :], sn[None, :], dt)

        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HDP], tl.float32)
        if CHUNK <= TILE:  # one step: nothing to read ahead (16 rows 0.66× the time on an H100)
            if start < end:
                m_i, l_i, acc = _attend(q, k, v, rt < end - start, m_i, l_i, acc, scale, dt, IEEE)
        else:
            for t0 in range(start, end, TILE):
                this_k, this_v = k, v
                k, v = _past_tile(KP, VP, TABLES + m * stride_tab, t0 + TILE + rt, end, kvh, rd, d_ok, stride_kb,
                                  stride_ks, BS, HD)
                m_i, l_i, acc = _attend(q, this_k, this_v, t0 + rt < end, m_i, l_i, acc, scale, dt, IEEE)

        if ctx // CHUNK == s:  # the new token is at position ctx
            kb = row + G * KVH * HD + kvh * HD
            vb = row + (G + 1) * KVH * HD + kvh * HD
            kn = tl.load(kb + rd, mask=d_ok, other=0.0).to(tl.float32)
            knp = tl.load(kb + partner, mask=d_ok, other=0.0).to(tl.float32)
            if QK_NORM:
                rk = 1.0 / tl.sqrt(tl.sum(kn * kn, axis=0) / HD + eps)
                wk = tl.load(KW + rd, mask=d_ok, other=0.0).to(tl.float32)
                wkp = tl.load(KW + partner, mask=d_ok, other=0.0).to(tl.float32)
                kn, knp = _head_norm(kn, knp, rk, wk, wkp, dt)
            kn = _rope(kn, knp, sign, c, sn, dt)
            vn = tl.load(vb + rd, mask=d_ok, other=0.0)
            sc_n = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale
            m_new = tl.maximum(m_i, sc_n)
            alpha = tl.exp(m_i - m_new)
            pn = tl.exp(sc_n - m_new)
            l_i = l_i * alpha + pn
            acc = acc * alpha[:, None] + pn.to(dt).to(tl.float32)[:, None] * vn.to(tl.float32)[None, :]
            m_i = m_new
            if WRITE_POOL:
                if tl.load(VALID + m) != 0:
                    block = tl.load(TABLES + m * stride_tab + ctx // BS)
                    at = block * stride_kb + (ctx % BS) * stride_ks + kvh * HD
                    tl.store(KP + at + rd, kn, mask=d_ok)
                    tl.store(VP + at + rd, vn, mask=d_ok)
            else:
                out = (m * KVH + kvh) * HD
                tl.store(KOUT + out + rd, kn, mask=d_ok)
                tl.store(VOUT + out + rd, vn, mask=d_ok)

        out_at = OUT + m * stride_out + heads[:, None] * HD + rd[None, :]
        if SPLITS == 1:
            tl.store(out_at, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=q_ok)
        else:
            part = (m * KVH * G + heads) * SPLITS  # [GP]: each head's first split
            g1 = rg < G
            tl.store(MPART + part + s, m_i, mask=g1)
            tl.store(LPART + part + s, l_i, mask=g1)
            tl.store(OPART + (part + s)[:, None] * HD + rd[None, :], acc, mask=q_ok)
            group = m * KVH + kvh
            if arrived_last(ARRIVALS, group, used):
                rh = tl.arange(0, GM)  # the group's heads again, padded to a power of two only
                h_ok = rh < G
                out = _merge_splits(OPART, MPART, LPART, group * G + rh, h_ok, rd, d_ok, used, GM, HD, HDP, SPLITS, MC)
                tl.store(OUT + m * stride_out + (kvh * G + rh)[:, None] * HD + rd[None, :],
                         out.to(OUT.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
                tl.atomic_xchg(ARRIVALS + group, 0)

    @triton.jit
    def _merge_splits(OPART, MPART, LPART, heads, h_ok, rd, d_ok, used, GM: tl.constexpr, HD: tl.constexpr,
                      HDP: tl.constexpr, SPLITS: tl.constexpr, MC: tl.constexpr):
        """Softmax-weighted sum of the first ``used`` splits of ``heads`` [GM] (the group's heads,
        ``h_ok`` those that exist) [GM, HDP], in one pass: ``MC`` splits at a time, their maxima, sums
        and partial outputs loaded together (the partials of every head of the group at once, so
        that a step's loads are all in flight together), the running sums rescaled to a new maximum
        as it rises, as the splits themselves do over their positions. Splits that saw no position
        (maximum -inf) weigh nothing. Reads through L2 (``.cg``): other programs wrote the
        partials. The loop runs to ``used``, so the merge costs what the row's context holds,
        whatever the table's width; the heads are padded to a power of two, not to the dot's 16
        rows, so a step takes twice the splits for Qwen2-VL's groups of 6."""
        part = heads * SPLITS  # [GM]: each head's first split
        rc = tl.arange(0, MC)
        top = tl.full([GM], float("-inf"), tl.float32)
        num = tl.zeros([GM, HDP], tl.float32)
        den = tl.zeros([GM], tl.float32)
        for j0 in range(0, used, MC):
            ok = h_ok[:, None] & (j0 + rc < used)[None, :]
            at = part[:, None] + j0 + rc[None, :]  # [GM, MC]
            mi = tl.load(MPART + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
            li = tl.load(LPART + at, mask=ok, other=0.0, cache_modifier=".cg")
            o = tl.load(OPART + at[:, :, None] * HD + rd[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                        other=0.0, cache_modifier=".cg")
            new_top = tl.maximum(top, tl.max(mi, axis=1))
            seen = new_top > float("-inf")  # padded heads never see a split
            rescale = tl.where(seen, tl.exp(top - new_top), 0.0)
            w = tl.where(mi > float("-inf"), tl.exp(mi - tl.where(seen, new_top, 0.0)[:, None]), 0.0)
            num = num * rescale[:, None] + tl.sum(w[:, :, None] * o, axis=1)
            den = den * rescale + tl.sum(w * li, axis=1)
            top = new_top
        return num / tl.where(h_ok, den, 1.0)[:, None]


@dataclass(frozen=True, slots=True)
class AttentionTiling:
    """How the attention cuts its work.

    - ``tile``: positions a step of a split reads (K and V of a KV head, ``tile`` × head_dim each);
    - ``chunk``: the fewest positions a split takes;
    - ``programs``: the programs it aims to launch. One row and KV head over a whole context is far
      too little work to fill a GPU, so the context is split; with many rows, fewer and longer
      splits fill it as well and leave fewer partial results to merge;
    - ``merge_values``: partial outputs the last split merges at a time (splits × the group's heads
      × head_dim, each padded to a power of two; for Qwen2-VL's groups of 6 heads of 128, 16 splits
      a step);
    - ``warps``: warps a program;
    - ``registers``: a cap on registers a thread (``maxnreg``), None for the compiler's choice. A
      Qwen2-VL-2B program (steps of 128, 4 warps) takes 186 on sm_90 with Triton 3.6, so two fit an
      SM; held to 168, three fit without spilling. On an H100 that made 16 rows no faster (8.02
      against 7.98 µs a layer), nor did merging 8 splits a step (9.21), so neither is the default
      (docs/results/probes/h100-attention-one-step).
    """

    tile: int = 128
    chunk: int = 128
    programs: int = 1024
    merge_values: int = 16384
    warps: int = 4
    registers: int | None = None

    def __post_init__(self) -> None:
        if self.tile < 16 or pow2(self.tile) != self.tile:
            raise ValueError(f"a step reads a power of two of at least 16 positions (the dot's least); got {self.tile}")
        if min(self.chunk, self.programs, self.merge_values, self.warps) < 1:
            raise ValueError(f"chunk, programs, merge values and warps must be positive: {self}")
        if self.registers is not None and not 24 <= self.registers <= 255:
            raise ValueError(f"a thread holds 24 to 255 registers; got a cap of {self.registers}")

    def chunk_for(self, rows: int, kv_heads: int, positions: int) -> int:
        """Context positions a split of a table of ``positions`` takes: :attr:`chunk` (one row: as
        many splits as that gives), longer, in whole tiles, where ``rows`` × ``kv_heads`` × splits
        would pass :attr:`programs`."""
        splits = max(1, min(-(-self.programs // (rows * kv_heads)), -(-positions // self.chunk)))
        per_split = -(-positions // splits)
        return max(self.chunk, -(-per_split // self.tile) * self.tile)


# On an H200 (scripts/probe_attention_splits.py, each row its own pages, a Qwen2-VL-2B layer at
# 1,024 positions) steps of 128 took 4.85 µs at 1 row, 5.06 at 4 and 10.9 at 16, against 5.53,
# 7.04 and 14.3 for steps of 32: fewer, longer splits leave less to merge. A split of one step that
# reads no step ahead took an H100's 16 rows from 12.2 to 8.1 µs (1 row: 5.0 to 4.5).
TILING = AttentionTiling()


def paged_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor, *, heads: int,
                    kv_heads: int, head_dim: int, valid: torch.Tensor | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                    workspace: SplitWorkspace | None = None, tiling: AttentionTiling = TILING) -> torch.Tensor:
    """Attention of one new token per row over its past in the pool and itself, its work cut as
    ``tiling`` says.

    ``qkv`` [M, (heads + 2 kv_heads) · head_dim] straight from the product (RoPE not yet
    applied); ``cos``/``sin`` [M, head_dim]; ``k_pool``/``v_pool`` one layer's
    [blocks, block_size, kv_heads, head_dim]; ``tables`` [M, width]; ``context_lens`` [M].
    With ``valid`` [M] the new K/V go into the pool at slot ``context_lens`` of each valid
    row; with ``new_kv`` (two [M, kv_heads, head_dim] tensors) they are returned there
    instead. ``qk_norm`` (q weight [head_dim], k weight [head_dim], eps): each head of q and
    of the new k is RMSNorm'd before RoPE (Qwen3). Where the context is split, the splits
    count their arrivals in ``workspace`` (one count a row and KV head, grown outside captures
    only; a fresh one per call otherwise). Returns [M, heads · head_dim].
    """
    if (valid is None) == (new_kv is None):
        raise ValueError("pass exactly one of valid (write the pool) and new_kv (return K/V)")
    if k_pool.stride(3) != 1 or k_pool.stride(2) != head_dim or k_pool.dtype != qkv.dtype:
        raise ValueError("the pool must be [blocks, block_size, kv_heads, head_dim], contiguous per token, "
                         f"in the model's dtype ({qkv.dtype}); got {k_pool.dtype} with strides {k_pool.stride()}")
    m = qkv.shape[0]
    groups = heads // kv_heads
    block_size = k_pool.shape[1]
    chunk = tiling.chunk_for(m, kv_heads, tables.shape[1] * block_size)
    splits = triton.cdiv(tables.shape[1] * block_size, chunk)
    out = torch.empty(m, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    parts_o = parts_m = parts_l = arrivals = out
    if splits > 1:
        parts_o = torch.empty(m, heads, splits, head_dim, dtype=torch.float32, device=qkv.device)
        parts_m = torch.empty(m, heads, splits, dtype=torch.float32, device=qkv.device)
        parts_l = torch.empty_like(parts_m)
        _, arrivals = (workspace or SplitWorkspace(qkv.device)).take(0, m * kv_heads)
    k_out, v_out = new_kv if new_kv is not None else (k_pool, v_pool)
    ieee = qkv.dtype == torch.float32
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    gm, hdp = pow2(groups), max(16, pow2(head_dim))  # the merge pads the heads to a power of two, the dot to 16
    _attention_kernel[(m, kv_heads, splits)](
        qkv, cos, sin, k_pool, v_pool, tables, context_lens, valid if valid is not None else context_lens,
        k_out, v_out, parts_o, parts_m, parts_l, arrivals, out, q_weight, k_weight,
        qkv.stride(0), cos.stride(0), tables.stride(0), k_pool.stride(0), k_pool.stride(1), out.stride(0),
        head_dim ** -0.5, eps, KVH=kv_heads, G=groups, GP=max(16, gm), HD=head_dim, HDP=hdp, BS=block_size,
        CHUNK=chunk, TILE=tiling.tile, SPLITS=splits, GM=gm,
        MC=max(1, min(pow2(splits), tiling.merge_values // (gm * hdp))),
        WRITE_POOL=valid is not None, IEEE=ieee, QK_NORM=qk_norm is not None, **launch_options(qkv.device),
        num_warps=tiling.warps, num_stages=2, **({"maxnreg": tiling.registers} if tiling.registers else {}))
    return out
