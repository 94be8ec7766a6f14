"""The fused decode step's two ends, one kernel each: the rows' inputs (each token's embedding and
the RoPE cos/sin of its position), and in greedy bursts the next ids (each row's argmax) with the
valid rows' positions and context lengths moved on. At 2 to 16 rows the final norm before the head
is a kernel too (:func:`final_norm`; at one row the head's product takes it as a prologue).

Written in torch these ends were some seventeen small kernels a step: the lookup; the angles,
their concatenation, cos, sin, the scaling and the casts; then the logits cast to float32, the
argmax, and the additions. Each waited for the one before and came between the dependent
launches of the step's own kernels: on an H200, 31 µs of kernel time a token, with 28 µs of gaps
between all of the step's kernels, in a 1,012 µs 4-bit step at batch 1 (``decode_timeline`` of
docs/results/probes/h200-profile-w4-b1.json). With the two kernels 4-bit batch-1 decode on an H100
went from 1,029 to 1,063 tok/s, in turns in one call (a reading: two of its twelve timed runs were
not quiet; docs/results/probes/h100-step-ends).
``$EDGEINFER_STEP_ENDS=0`` brings the torch ops back.

Both keep torch's arithmetic. An angle is the float32 product of the position and the inverse
frequency, as :meth:`~edgeinfer.models.decoder.Decoder.rope` computes it, and Triton's cos and sin
of float32 are libdevice's, the CUDA math library torch's own kernels call; M-RoPE's choice of axis per frequency
is :func:`~edgeinfer.models.decoder.mrope_frequencies` itself, applied once to the axes' numbers.
The argmax takes the first of equal maxima, and the first NaN over any number, as torch's does.
The final norm rounds where ``RMSNorm`` does; its sum of squares is taken in another order, so a
row may round the other way in the last place.
"""

from __future__ import annotations

import torch

from edgeinfer.models.decoder import mrope_frequencies
from edgeinfer.quant.launching import SplitWorkspace, launch_options, pow2

try:  # the import decides whether this path exists at all
    import triton
    import triton.language as tl

    from edgeinfer.quant.kernels import arrived_last, await_inputs
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = None

# Logits a program of the argmax reads: 75 programs a row for Qwen2-VL's 151,936 ids.
ARGMAX_BLOCK = 2048
# Hidden columns a program of the lookup copies.
EMBED_BLOCK = 1024

if triton is not None:
    _NO_INDEX = tl.constexpr(2**30)  # above any vocabulary: where a block holds no maximum

    @triton.jit
    def _inputs_kernel(TOKENS, POS, EMBED, INV_FREQ, AXIS, X, COS, SIN, stride_axis, stride_pos, stride_embed,
                       stride_column, stride_x, stride_cs, H, scaling, embed_scale, HALF: tl.constexpr, HALF_P: tl.constexpr,
                       BH: tl.constexpr, EMBED_ROWS: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
        """Row ``program_id(0)``: with ``EMBED_ROWS``, hidden columns ``program_id(1)·BH ..`` of its token's
        embedding (times ``embed_scale``, rounded as torch's product, where ``SCALED``); the first
        program of the row also writes its cos/sin [2·HALF]."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        await_inputs(PDL)  # the ids and positions are the step before's
        if EMBED_ROWS:
            rh = part * BH + tl.arange(0, BH)
            h_ok = rh < H
            token = tl.load(TOKENS + row)
            e = tl.load(EMBED + token * stride_embed + rh * stride_column, mask=h_ok)
            if SCALED:
                e = (e.to(tl.float32) * embed_scale).to(X.dtype.element_ty)
            tl.store(X + row * stride_x + rh, e, mask=h_ok)
        if part == 0:
            j = tl.arange(0, HALF_P)
            j_ok = j < HALF
            axis = tl.load(AXIS + j, mask=j_ok, other=0)
            position = tl.load(POS + axis * stride_axis + row * stride_pos, mask=j_ok, other=0)
            angle = position.to(tl.float32) * tl.load(INV_FREQ + j, mask=j_ok, other=0.0)
            c = (tl.cos(angle) * scaling).to(COS.dtype.element_ty)
            s = (tl.sin(angle) * scaling).to(SIN.dtype.element_ty)
            at = row * stride_cs + j
            tl.store(COS + at, c, mask=j_ok)
            tl.store(COS + at + HALF, c, mask=j_ok)
            tl.store(SIN + at, s, mask=j_ok)
            tl.store(SIN + at + HALF, s, mask=j_ok)

    @triton.jit
    def _first_max(v, index):
        """The largest of ``v`` and the least ``index`` holding it; a NaN, where there is one, is
        the largest (the first NaN's index)."""
        nan = v != v
        top = tl.max(tl.where(nan, float("-inf"), v), axis=0)
        first_top = tl.min(tl.where(v == top, index, _NO_INDEX), axis=0)
        first_nan = tl.min(tl.where(nan, index, _NO_INDEX), axis=0)
        has_nan = first_nan < _NO_INDEX
        return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)

    @triton.jit
    def _choose_kernel(LOGITS, PARTS, ARRIVALS, IDS, POS, CTX, VALID, V, stride_l, stride_axis, stride_pos,
                       AXES: tl.constexpr, BV: tl.constexpr, P: tl.constexpr, ADVANCE: tl.constexpr,
                       PDL: tl.constexpr):
        """Block ``program_id(1)`` of row ``program_id(0)``'s logits: its first maximum into
        ``PARTS`` [rows, 2, P] (value, index); the last block of the row to arrive takes the first
        maximum of the blocks' into ``IDS``, and with ``ADVANCE`` moves each of the row's ``AXES``
        positions and its context length on by ``VALID``."""
        row = tl.program_id(0)
        block = tl.program_id(1)
        blocks = tl.num_programs(1)
        await_inputs(PDL)  # the logits are the head's
        rv = block * BV + tl.arange(0, BV)
        v = tl.load(LOGITS + row * stride_l + rv, mask=rv < V, other=float("-inf")).to(tl.float32)
        top, at = _first_max(v, rv)
        base = PARTS + row * 2 * P
        tl.store(base + block, top)
        tl.store(base + P + block, at.to(tl.float32))  # exact: ids are below 2^24
        if arrived_last(ARRIVALS, row, blocks):
            rp = tl.arange(0, P)
            p_ok = rp < blocks
            tops = tl.load(base + rp, mask=p_ok, other=float("-inf"), cache_modifier=".cg")
            ats = tl.load(base + P + rp, mask=p_ok, other=_NO_INDEX, cache_modifier=".cg").to(tl.int32)
            _, chosen = _first_max(tops, ats)
            tl.store(IDS + row, chosen.to(IDS.dtype.element_ty))
            if ADVANCE:
                step = tl.load(VALID + row)
                for a in tl.static_range(AXES):
                    p_at = POS + a * stride_axis + row * stride_pos
                    tl.store(p_at, tl.load(p_at) + step)
                tl.store(CTX + row, tl.load(CTX + row) + step)
            tl.atomic_xchg(ARRIVALS + row, 0)


    @triton.jit
    def _norm_kernel(X, W, Y, stride_x, stride_y, H, eps, BH: tl.constexpr, PDL: tl.constexpr):
        """Row ``program_id(0)`` of X RMSNorm'd into Y, rounded as ``RMSNorm`` rounds: the mean of the
        squares in float32, the row times 1/√(mean + eps) rounded to X's dtype, then times the weight,
        rounded again."""
        row = tl.program_id(0)
        rh = tl.arange(0, BH)
        h_ok = rh < H
        w = tl.load(W + rh, mask=h_ok, other=0.0).to(tl.float32)
        await_inputs(PDL)  # the row is the last layer's
        x = tl.load(X + row * stride_x + rh, mask=h_ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        xn = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * stride_y + rh, (xn * w).to(Y.dtype.element_ty), mask=h_ok)


class StepEnds:
    """The two ends of ``decoder``'s fused decode step, and its final norm at several rows, their
    arrival counts in ``workspace`` (the step's: its kernels run one after another). With
    ``kernels`` (Triton on CUDA, or its interpreter) a kernel each; without, torch's ops
    (``$EDGEINFER_STEP_ENDS=0``), the same values (the final norm's within a rounding)."""

    def __init__(self, decoder, workspace: SplitWorkspace, kernels: bool = True) -> None:
        cfg = decoder.cfg
        self.decoder = decoder
        self.workspace = workspace
        self.kernels = kernels
        self.inv_freq = decoder.inv_freq.float().contiguous()
        half = self.inv_freq.numel()
        # The axis each frequency follows: mrope_frequencies picks the same entries from the axes' numbers.
        axes = torch.arange(3, dtype=torch.float32, device=self.inv_freq.device)[:, None].expand(3, half)
        axis = axes[0] if cfg.mrope_section is None else mrope_frequencies(axes, cfg.mrope_section,
                                                                             cfg.mrope_interleaved)
        self.axis = axis.to(torch.int32).contiguous()
        self.scaling = float(decoder.attention_scaling)
        dtype = decoder.embed_table.dtype
        self.embed_scale = float(torch.tensor(cfg.embed_scale, dtype=dtype))  # as embed_tokens rounds it

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, head_dim] in ``dtype`` for positions [B, 1], or [3, B, 1] with M-RoPE: the
        values of ``Decoder.rope``."""
        if not self.kernels:
            rows = positions.shape[-2]
            return tuple(t.reshape(rows, -1) for t in self.decoder.rope(positions, dtype))
        return self._launch(None, positions, dtype)[1:]

    def inputs(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embeddings [B, hidden] of ids [B] and the cos, sin of :meth:`rope`."""
        dtype = self.decoder.embed_table.dtype
        if not self.kernels:
            return self.decoder.embed_tokens(ids), *self.rope(positions, dtype)
        return self._launch(ids, positions, dtype)

    def _launch(self, ids, positions, dtype):
        table = self.decoder.embed_table
        rows = positions.shape[-2]
        hidden, half = table.shape[1], self.inv_freq.numel()
        device = positions.device
        x = torch.empty(rows, hidden, dtype=dtype, device=device) if ids is not None else None
        cos = torch.empty(rows, 2 * half, dtype=dtype, device=device)
        sin = torch.empty_like(cos)
        stride_axis = positions.stride(0) if positions.dim() == 3 else 0
        parts = triton.cdiv(hidden, EMBED_BLOCK) if ids is not None else 1
        _inputs_kernel[(rows, parts)](
            ids if ids is not None else positions, positions, table, self.inv_freq, self.axis,
            x if x is not None else cos, cos, sin, stride_axis, positions.stride(-2), table.stride(0), table.stride(1),
            hidden if x is None else x.stride(0), cos.stride(0), hidden, self.scaling, self.embed_scale, HALF=half,
            HALF_P=pow2(half), BH=EMBED_BLOCK, EMBED_ROWS=ids is not None, SCALED=self.embed_scale != 1.0,
            **launch_options(device))
        return x, cos, sin

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's final norm of rows ``x`` [B, hidden], before the head: one kernel
        (:func:`final_norm`) with :attr:`kernels`, the module otherwise (and for a norm the kernel
        does not take: Gemma's offset, or a weight in another dtype than the rows')."""
        norm = self.decoder.norm
        if not self.kernels or norm.offset or norm.weight.dtype != x.dtype:
            return norm(x)
        return final_norm(x, norm.weight, norm.eps)

    def choose(self, logits: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor | None = None,
               context_lens: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> None:
        """:func:`choose_greedy` in the step's workspace (with :attr:`kernels` only: without, the
        caller's sampler path chooses)."""
        choose_greedy(logits, ids, self.workspace, positions, context_lens, valid)


def final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [B, hidden] by ``weight`` [hidden] (``x``'s dtype), in one kernel of
    a program a row, with ``RMSNorm``'s roundings. Torch's eight ops for the same took 17 µs of
    kernel time a step at 16 rows on an H100, each launched after the one before finished."""
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, hidden = x.shape
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    bh = pow2(hidden)
    _norm_kernel[(rows,)](x, weight, y, x.stride(0), y.stride(0), hidden, eps, BH=bh,
                          num_warps=4 if bh <= 4096 else 8, **launch_options(x.device))
    return y


def choose_greedy(logits: torch.Tensor, ids: torch.Tensor, workspace: SplitWorkspace,
                  positions: torch.Tensor | None = None, context_lens: torch.Tensor | None = None,
                  valid: torch.Tensor | None = None) -> None:
    """Each row's argmax of ``logits`` [B, vocab] into ``ids`` [B], in one kernel (its arrival counts
    in ``workspace``). With ``positions`` ([B, 1] or [3, B, 1]), ``context_lens`` and ``valid`` [B],
    each row's positions and context length also move on by its ``valid``."""
    advance = positions is not None
    if advance and (context_lens is None or valid is None):
        raise ValueError("moving the rows on needs their context lengths and which are valid")
    rows, vocab = logits.shape
    blocks = triton.cdiv(vocab, ARGMAX_BLOCK)
    p = pow2(blocks)
    parts, arrivals = workspace.take(rows * 2 * p, rows)
    pos = positions if advance else ids
    mrope = advance and pos.dim() == 3
    _choose_kernel[(rows, blocks)](
        logits, parts, arrivals, ids, pos, context_lens if advance else ids, valid if advance else ids, vocab,
        logits.stride(0), pos.stride(0) if mrope else 0, pos.stride(-2) if advance else 0,
        AXES=pos.shape[0] if mrope else 1, BV=ARGMAX_BLOCK, P=p, ADVANCE=advance, **launch_options(logits.device))
