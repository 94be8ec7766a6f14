"""Decode steps replayed from CUDA graphs.

At batch 1 a decode step of a small model is hundreds of short kernels; launched one by
one from Python they cost more than the memory traffic they do. The step is captured
once per (batch bucket, block-table width bucket) and replayed: inputs are copied into
the graph's static buffers, padding rows get ``context_lens = 0`` (they attend to
themselves only and their outputs are dropped), and the past is read through whole
blocks under a mask so no shape depends on the context length.

A prompt chunk (batch 1, T > 1) replays from a graph too, one per length bucket (``T``
padded up to 16, 32, ... 256, then to a multiple of 256) and past: none, the first chunk
of a fresh prompt, attended causally; or whole blocks under a mask. The padding tokens
come after the real ones, so causal attention keeps them out of every real token's
result; their K/V are dropped and the logits are those of the last real token. Eagerly,
a chunk of a thousand tokens through a 2B decoder is a thousand kernel launches, and
the host's time launching them was three times the device's running them. At most
``prefill_graphs`` such graphs are kept, the least recently used dropped first; a length
seen for the first time is captured then, which costs about three eager chunks once (a
prompt's first chunk of each length is captured at start-up where a budget allows, see
:meth:`CudaGraphDecoderEngine.capture_all`). A first chunk's graph holds its layers compiled,
once for every length (with the norms, RoPE and SiLU of thousand-token chunks fused, the first
tokens of 32 requests at once came 28.7 ms apart on an H200, against 33.5 ms); a chunk after a
past holds them as written.

Where Triton is installed, every decode step attends with the paged attention kernel of
:mod:`edgeinfer.backends.torch.triton_decode`, which reads the past where it lies in the pool;
a batch-1 step's products are that module's kernels too (six per layer), a larger batch's are
its layers' own, compiled by ``torch.compile``, on either side of the attention. Machines
without Triton (and the Gemma layers, which the kernels do not implement) run whole layers
compiled over the past gathered into whole blocks under a mask.

Decoding can go further (``decode_burst``): a second graph takes token ids rather than
embeddings, writes its K/V into the pool itself and chooses the next ids on the device (the
argmax where every row is greedy; otherwise the engine's sampler, passed down as
``sampling``, whose random numbers are keyed by each request's seed and step, with its
buffers captured as well), feeding them back as the next input, so several steps replay
back to back with one copy to the host at the end. The host's share of a step
(scheduling, index tensors, the token's round trip) is then paid once per burst, not once
per token. That copy does not block: ``continue_burst`` queues the next burst of the same
rows from where the last one stopped (its ids, positions, context lengths and sampler
counters are still in the graph's buffers) before the host reads the last one's ids, so the
device runs on while the host takes its turn. Burst graphs are keyed by the sampler's kind
too (greedy only, drawing, penalizing), so an all-greedy batch runs the argmax alone.

Across a sleep the engine stays: ``release_captures`` drops every graph (they hold the KV
pools' and the weights' addresses) and keeps the compiled layers, the fused step's tile choices
and the sampler buffers; ``recapture`` captures the same graphs again over the new pools, so the
wake pays for them and nothing is compiled or tuned again.

The engine changes nothing outside itself unless told to: torch's compiler settings are
raised only around its own compiled calls, and the decoder's matrices are re-laid out (in
place: values and shapes unchanged, strides changed) only for an engine that was handed the
decoder to keep (``take_decoder=True``, as ``Engine.load`` does with the model it loaded).
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from edgeinfer import tile_cache
from edgeinfer.progress import RichSteps, stderr_bars
from edgeinfer.backends.base import BurstSampling, SamplingStep
from edgeinfer.backends.torch import triton_decode
from edgeinfer.backends.torch.eager import TorchDecoderEngine, capture_graph, warm_up
from edgeinfer.models.decoder import Decoder, DecoderLayer, layer_masks, past_reader, whole_block_slots_and_mask
from edgeinfer.quant.launching import dependent_launch, integer_dot_enabled, staged_enabled


# One compiled layer serves every (batch, width) bucket of every engine in the process; torch's
# default limit of 8 variants of one compiled function would be hit by a few buckets.
COMPILED_VARIANTS = 256


def _recompile_limit_name() -> str:
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6


def with_variants(compiled: Callable, variants: int = COMPILED_VARIANTS) -> Callable:
    """``compiled`` (a ``torch.compile``'d function) run with room for ``variants`` compiled
    variants: torch's limit is raised for the call only, never for the rest of the process."""
    name = _recompile_limit_name()

    def call(*args, **kwargs):
        limit = max(getattr(torch._dynamo.config, name), variants)
        with torch._dynamo.config.patch(**{name: limit}):
            return compiled(*args, **kwargs)

    return call


def _compiled(fn: Callable, dynamic: bool = False) -> Callable:
    """``fn`` compiled for static shapes, one variant per batch and width bucket; ``dynamic``:
    one variant for every length (a prompt chunk's token count)."""
    return with_variants(torch.compile(fn, dynamic=dynamic, fullgraph=True))


def _prompt_layer(layer: DecoderLayer, *inputs):
    """A layer over a prompt chunk: its own frame, so that the compiled variants for any length are
    kept apart from the decode steps' static ones (torch keeps them per frame)."""
    return DecoderLayer.forward(layer, *inputs)


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from ``start`` up to the first one >= ``limit``."""
    out = [start]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


def bucket_for(value: int, choices: list[int]) -> int | None:
    return next((c for c in choices if c >= value), None)


def prefill_bucket(tokens: int) -> int:
    """A prompt chunk's padded length: the next power of two from 16 to 256, then the next
    multiple of 256 (at most an eighth more tokens than the chunk has, past 2,048)."""
    if tokens <= 256:
        return max(16, 1 << (tokens - 1).bit_length())
    return -(-tokens // 256) * 256


def _matrices(decoder: Decoder) -> list[torch.nn.Parameter]:
    """The decoder's dense product matrices (packed low-bit ones have one layout only)."""
    names = ("qkv_t", "o_t", "gate_up_t", "down_t")
    every = [getattr(layer, n) for layer in decoder.layers for n in names] + [decoder.lm_head_t]
    return [p for p in every if isinstance(p, torch.nn.Parameter)]


def _relayout(decoder: Decoder, out_major: bool) -> None:
    """Store every ``[in, out]`` matrix row-major (``in_out``) or as the transpose of a row-major
    ``[out, in]`` (``out_in``, what ``F.linear`` reads); the values and shapes stay the same."""
    for p in _matrices(decoder):
        p.data = p.data.t().contiguous().t() if out_major else p.data.contiguous()


def _is_out_major(decoder: Decoder) -> bool:
    return all(p.t().is_contiguous() for p in _matrices(decoder))


def choose_weight_layout(decoder: Decoder, repeats: int = 50, apply: bool = True) -> dict:
    """Time a batch-1 product with the widest matrix in both layouts on this device; with
    ``apply``, re-lay out ``decoder`` in place to the faster.

    cuBLAS picks different kernels for ``x @ W`` by layout, and which one streams memory
    faster depends on the GPU and the shape, so the device decides, once, at load.
    """
    dense = _matrices(decoder)
    if not dense:
        return {"chosen": "packed", "applied": False}
    gate_up = decoder.layers[0].gate_up_t
    probe = gate_up if isinstance(gate_up, torch.nn.Parameter) else max(dense, key=torch.Tensor.numel)
    x = torch.randn(1, probe.shape[0], dtype=probe.dtype, device=probe.device)
    times = {}
    for name, weight in (("in_out", probe.data.contiguous()), ("out_in", probe.data.t().contiguous().t())):
        for _ in range(5):
            x @ weight
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            x @ weight
        end.record()
        torch.cuda.synchronize(probe.device)
        times[name] = start.elapsed_time(end) / repeats * 1e3
        del weight
    chosen = min(times, key=times.get)
    if apply:
        _relayout(decoder, out_major=chosen == "out_in")
    return {"chosen": chosen, "applied": apply, **{f"{k}_us": round(v, 2) for k, v in times.items()}}


@dataclass
class _BurstGraph:
    replay: Callable[[], None]  # the graph's replay; on a CPU, the step itself (tests run it there)
    tokens: torch.Tensor  # [batch] the input ids; each replay leaves the next ones here
    positions: torch.Tensor
    tables: torch.Tensor
    context_lens: torch.Tensor
    valid: torch.Tensor  # [batch] 1 for real rows, 0 for padding
    sampling: SamplingStep | None = None  # None: every row takes the argmax


class BurstTokens:
    """A burst's ids [B, steps] on their way to the host: copied without blocking into pinned
    memory behind the burst, so the host can queue more work first; ``rows()`` waits for them."""

    def __init__(self, ids: torch.Tensor) -> None:
        self._event = None
        self._host = ids
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def rows(self) -> list[list[int]]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    embeds: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    context_lens: torch.Tensor
    logits: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor


@dataclass
class _PrefillGraph:
    replay: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # -> logits, new_k, new_v
    embeds: torch.Tensor  # [1, bucket, hidden]
    positions: torch.Tensor
    tables: torch.Tensor
    context_lens: torch.Tensor
    last: torch.Tensor  # [1] index of the chunk's last real token


class CudaGraphDecoderEngine(TorchDecoderEngine):
    """The torch decoder engine with decode steps captured in CUDA graphs.

    ``take_decoder``: the engine keeps ``decoder`` for itself and re-lays out its matrices in
    place for the kernels that read them (the fused kernels need ``[out, in]`` row-major;
    otherwise the faster layout is timed on this GPU). Without it the decoder is left as it
    is: the fused kernels run only where it is already laid out for them, and the timed
    layout is reported, not applied.
    """

    def __init__(self, decoder: Decoder, max_batch_size: int, max_blocks: int, compile_layers: bool = True,
                 fused: bool = True, prefill_graphs: int = 8, *, take_decoder: bool = False,
                 step_tuning_s: float = 0.0) -> None:
        super().__init__(decoder)
        self.step_tuning_s = step_tuning_s  # for the fused step's tiles, by whole-step time (0: none)
        self.batch_buckets = buckets(max_batch_size)
        self.width_buckets = buckets(max_blocks, start=8)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self.prefill_graphs = prefill_graphs
        self._prefills: OrderedDict[tuple[int, int, int], _PrefillGraph] = OrderedDict()
        self.prefill_error: str | None = None  # why prompt chunks run eagerly, after a failed capture
        self.prefill_replays = 0
        self._bursts: dict[tuple, _BurstGraph] = {}
        self._last_burst: tuple[tuple, int] | None = None  # its graph's key and rows
        self._sampling: dict[tuple, SamplingStep] = {}  # per (batch bucket, sampler kind): shared by every width
        self._pool = None  # graphs share one memory pool
        self.captures = 0
        self._released: list[tuple[str, tuple, torch.dtype | None]] = []  # graphs dropped by a sleep
        self.compile_error: str | None = None
        self.prompt_compile_error: str | None = None  # why prompt chunks capture their layers as written
        # Why the fused Triton step is not used (None: it is).
        self.fused_off = "turned off" if not fused else triton_decode.available(self.device)
        self._fused = None
        self.fused_replays = 0  # decode steps replayed through the fused kernels
        # A layer is a few dozen small kernels (norms, RoPE, residuals); compiled, they fuse.
        # Every layer has the same code and shapes, so one compilation serves all of them.
        self._layer_fn = _compiled(DecoderLayer.forward) if compile_layers else None
        # A prompt's first chunk's layers too: uncompiled, a thousand-token chunk's norms, RoPE and
        # SiLU are dozens of separate passes over its activations a layer. Compiled once for any length
        # (at start-up, with the first chunks' graphs). Chunks after a past run their layers as
        # written: they are captured on first use, and a compilation there would be on live traffic.
        self._prompt_layer_fn = _compiled(_prompt_layer, dynamic=True) if compile_layers else None
        if self.fused_off is None:
            halves = (_compiled(DecoderLayer.qkv), _compiled(DecoderLayer.after_attention)) if compile_layers else None
            try:
                self._fused = triton_decode.FusedDecode(decoder, halves)
            except ValueError as exc:
                self.fused_off = str(exc)
        self.weight_layout = self._lay_out(decoder, take_decoder)
        self._tune_fused()

    def _tune_fused(self) -> None:
        """Time the fused step's tiles at load, product by product and then, for up to
        ``step_tuning_s`` seconds, in the whole step. Left to its first use, the timing (a few
        seconds of compiling and replaying every candidate) fell on the first request whose prompt
        was mostly a cached prefix. Tiles an earlier process chose on this GPU are taken from the
        tile cache instead (:mod:`edgeinfer.tile_cache`). A failure falls back to the compiled
        layers, with a warning."""
        if self._fused is None or self.device.type != "cuda":
            return
        try:
            with stderr_bars(transient=True) as bars:  # a bar per phase where the tiles are timed
                self._fused.tune(self.step_tuning_s, tile_cache.default(), RichSteps(bars))
        except Exception as exc:  # noqa: BLE001 - any kernel or compiler failure has a fallback
            self.fused_off = f"{type(exc).__name__}: {exc}"[:500]
            self._fused = None
            warnings.warn(f"fused decode kernels failed, using compiled layers: {self.fused_off}")

    def _lay_out(self, decoder: Decoder, take_decoder: bool) -> dict | None:
        """The weight layout the decode step reads, re-laying out ``decoder`` only where it was handed over."""
        if self._fused is not None:
            if take_decoder:
                _relayout(decoder, out_major=True)  # the kernels read whole rows of [out, in]
            elif not _is_out_major(decoder):
                self.fused_off = "the decoder's weights are not laid out [out, in] and it was not handed over"
                self._fused = None
            if self._fused is not None:
                return {"chosen": "out_in"}
        if self.device.type != "cuda":
            return None
        return choose_weight_layout(decoder, apply=take_decoder)

    @property
    def kernel_report(self) -> dict:
        """The fused step's tile choices and speeds per product, or why it is off."""
        if self._fused is None:
            return {"fused": False, "reason": self.fused_off}
        return {"fused": True, "gemv_rows": triton_decode.MAX_GEMV_ROWS, "fused_rows": self._fused.rows_report,
                "fused_replays": self.fused_replays,
                "dependent_launch": dependent_launch(self.device), "step_ends": self._fused.ends.kernels,
                "staged_products": staged_enabled(),  # whether the staged tiles were the step's candidates
                "integer_dot": integer_dot_enabled(),  # the switch: packed_gemv's integer-dot tiles timed or not
                "tiles": self._fused.tiles_source,
                "compiled_ahead": self._fused.compiled_ahead, "products": self._fused.report,
                "step": self._fused.step_report, "rows_step": self._fused.rows_step_report}

    def capture_state(self) -> dict[str, int]:
        """What this engine captured and tuned so far: graphs captured in all, held now by kind, and
        whether the fused step's tiles are chosen (a benchmark reads the changes per request)."""
        return {"captures": self.captures, "decode_graphs": len(self._graphs), "prefill_graphs": len(self._prefills),
                "burst_graphs": len(self._bursts), "prefill_replays": self.prefill_replays,
                "compiled_prompt_layers": int(self._prompt_layer_fn is not None),
                "fused_tuned": int(self._fused is not None and bool(self._fused.configs)),
                "fused_row_tiles": len(self._fused.rows_report) if self._fused is not None else 0}

    # --- start-up -------------------------------------------------------------------------------
    def capture_plan(self, samplings: Seq[BurstSampling | None],
                     prompt_chunk: int = 0) -> list[tuple[str, tuple, BurstSampling | None]]:
        """Every graph live traffic can ask for, in the order :meth:`capture_all` takes them: the
        prompt chunks that start a prompt (no past), one per length bucket up to ``prompt_chunk``
        tokens (the largest ``prefill_graphs`` of them where there are more: only that many are
        kept); then for each batch bucket (smallest first) and each table width, the single decode
        step and a burst of each sampler kind in ``samplings`` (None: greedy). Chunks after a
        cached prefix or an earlier chunk (a past to read) are captured on first use."""
        cfg = self.decoder.cfg
        rank = 3 if cfg.mrope_section is not None else 2
        plan = []
        if self.prefill_graphs > 0 and prompt_chunk > 1:
            lengths = sorted({prefill_bucket(t) for t in range(2, prompt_chunk + 1)})[-self.prefill_graphs:]
            plan += [("prefill", (t, 0, rank, cfg.hidden_size), None) for t in lengths]
        for batch in self.batch_buckets:
            for width in self.width_buckets:
                plan.append(("decode", (batch, width, rank, cfg.hidden_size), None))
                plan += [("burst", (batch, width, rank, None if s is None else s.kind), s) for s in samplings]
        return plan

    @torch.inference_mode()
    def capture_all(self, k_pool: torch.Tensor, v_pool: torch.Tensor, samplings: Seq[BurstSampling | None],
                    budget_s: float, progress: Callable[[int, int], None] | None = None,
                    clock: Callable[[], float] = time.monotonic, prompt_chunk: int = 0) -> dict[str, float]:
        """Capture the graphs of :meth:`capture_plan` not captured yet, until ``budget_s`` seconds
        have passed (compiling the layers for each batch bucket on the way); those left are
        captured on first use, as without this. ``progress(done, total)`` after each graph.
        Returns what was captured, planned and the seconds it took."""
        held = {"decode": self._graphs, "burst": self._bursts, "prefill": self._prefills}
        plan = [(what, key, s) for what, key, s in self.capture_plan(samplings, prompt_chunk) if key not in held[what]]
        started, done = clock(), 0
        dtype = self.decoder.norm.weight.dtype
        for what, key, sampling in plan:
            if clock() - started > budget_s:
                break
            if what == "burst":
                self._capture_burst(key, k_pool, v_pool, sampling)
            else:  # the width of a row's embeddings is the key's last part
                embeds = torch.empty(1, 1, key[3], dtype=dtype, device=k_pool.device)
                if what == "decode":
                    self._capture(key, embeds, None, k_pool, v_pool)
                elif (graph := self._capture_prefill(key, embeds, k_pool, v_pool)) is not None:
                    self._prefills[key] = graph
            done += 1
            if progress is not None:
                progress(done, len(plan))
        return {"captured": done, "planned": len(plan), "seconds": clock() - started}

    # --- sleep ----------------------------------------------------------------------------------
    def release_captures(self) -> int:
        """Drop every graph and the memory pool they share, remembering their keys for
        ``recapture``; the compiled layers, tile choices and sampler buffers stay."""
        self._released = [("decode", key, g.embeds.dtype) for key, g in self._graphs.items()]
        self._released += [("prefill", key, g.embeds.dtype) for key, g in self._prefills.items()]  # oldest first
        self._released += [("burst", key, None) for key in self._bursts]
        self._graphs, self._prefills, self._bursts = {}, OrderedDict(), {}
        self._last_burst, self._pool = None, None
        return len(self._released)

    def recapture(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> int:
        """Capture the graphs ``release_captures`` dropped over ``k_pool``/``v_pool``; returns how many."""
        released, self._released = self._released, []
        captured = 0
        for kind, key, dtype in released:
            if kind == "burst":
                step = self._sampling.get((key[0], key[3])) if key[3] is not None else None
                self._capture_burst(key, k_pool, v_pool, None, step)
            else:
                like = torch.empty(1, 1, key[3], dtype=dtype, device=k_pool.device)  # the inputs' dtype and width
                if kind == "decode":
                    self._capture(key, like, None, k_pool, v_pool)
                elif self.prefill_error is None and (g := self._capture_prefill(key, like, k_pool, v_pool)):
                    self._prefills[key] = g
                else:
                    continue  # a chunk that cannot be captured runs eagerly, as before the sleep
            captured += 1
        return captured

    def _runs_fused(self, width: int) -> bool:
        """Whether rows of embeddings ``width`` wide take the fused step (rows carrying deepstack
        additions are wider, and run the compiled layers)."""
        return self._fused is not None and width == self.decoder.cfg.hidden_size

    def _static_step(self, embeds, positions, k_pool, v_pool, tables, context_lens, valid=None):
        """One token per row on static shapes. With ``valid`` (fused step only) the new K/V are
        written into the pools at each valid row's slot ``context_lens`` and come back as None."""
        if self._runs_fused(embeds.shape[-1]):
            cos, sin = self._fused.ends.rope(positions, embeds.dtype)
            return self._fused.layers(embeds[:, 0], cos, sin, k_pool, v_pool, tables, context_lens, valid)
        slots, mask = whole_block_slots_and_mask(tables, context_lens, k_pool.shape[2], 1)
        mask, window = layer_masks(self.decoder.cfg, mask, context_lens, slots.shape[1], 1)
        return self.decoder.run_layers(embeds, positions, past_reader(k_pool, v_pool, slots), mask, self._layer_fn,
                                       window_mask=window)

    @torch.inference_mode()
    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        if image_groups is not None:  # a chunk with images that attend both ways: eager, its mask follows them
            return super().step(inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups)
        b, t, _ = inputs_embeds.shape
        batch = bucket_for(b, self.batch_buckets)
        width = bucket_for(block_tables.shape[1], self.width_buckets)
        if t > 1 and b == 1 and width is not None and self.prefill_graphs > 0:
            out = self._prefill(inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, width)
            if out is not None:
                return out
        if t != 1 or batch is None or width is None or not inputs_embeds.is_cuda:
            return super().step(inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens)
        # Rows carrying deepstack additions are wider than plain ones: a graph of their own.
        key = (batch, width, position_ids.dim(), inputs_embeds.shape[-1])
        g = self._graphs.get(key) or self._capture(key, inputs_embeds, position_ids, k_pool, v_pool)
        g.embeds[:b].copy_(inputs_embeds)
        self._load(g, position_ids, block_tables, context_lens)
        g.graph.replay()
        self.fused_replays += self._runs_fused(key[3])
        return g.logits[:b], g.new_k[:, :b], g.new_v[:, :b]

    def _load(self, g: _Graph | _BurstGraph | _PrefillGraph, positions, tables, context_lens) -> None:
        """Copy a step's index inputs into a graph's static buffers; padding rows get context 0."""
        b, width = tables.shape
        device = g.tables.device
        g.positions[..., :b, :positions.shape[-1]].copy_(positions.to(device, non_blocking=True))
        g.tables.zero_()
        g.tables[:b, :width].copy_(tables.to(device, non_blocking=True))
        g.context_lens.zero_()
        g.context_lens[:b].copy_(context_lens.to(device, non_blocking=True))

    def _warm_up(self, run, device) -> None:
        """Run ``run`` twice on a side stream before a capture (timing the fused kernels' tiles or
        compiling the layers the first time). A failure of either falls back, with a warning: the
        fused kernels to the compiled layers, the compiled layers to eager ones."""
        while True:
            try:
                return warm_up(run, device)
            except Exception as exc:  # noqa: BLE001 - any kernel or compiler failure has a fallback
                reason = f"{type(exc).__name__}: {exc}"[:500]
                if self._fused is not None:
                    self.fused_off = reason
                    self._fused = None
                    warnings.warn(f"fused decode kernels failed, using compiled layers: {reason}")
                elif self._layer_fn is not None:
                    self.compile_error = reason
                    self._layer_fn = None
                    warnings.warn(f"compiled decoder layers failed, capturing eager layers: {reason}")
                else:
                    raise

    def _capture(self, key, embeds, positions, k_pool, v_pool) -> _Graph:
        batch, width, rank, _ = key
        device = embeds.device
        static_embeds = torch.zeros(batch, 1, embeds.shape[-1], dtype=embeds.dtype, device=device)
        pos_shape = (3, batch, 1) if rank == 3 else (batch, 1)
        static_positions = torch.zeros(pos_shape, dtype=torch.long, device=device)
        tables = torch.zeros(batch, width, dtype=torch.long, device=device)
        context_lens = torch.zeros(batch, dtype=torch.long, device=device)
        args = (static_embeds, static_positions, k_pool, v_pool, tables, context_lens)
        self._warm_up(lambda: self._static_step(*args), device)
        graph, (logits, new_k, new_v) = capture_graph(lambda: self._static_step(*args), self._pool)
        self._pool = graph.pool()
        self.captures += 1
        g = _Graph(graph, static_embeds, static_positions, tables, context_lens, logits, new_k, new_v)
        self._graphs[key] = g
        return g

    # --- prompt chunks -------------------------------------------------------------------------
    def _prefill_step(self, embeds, positions, k_pool, v_pool, tables, context_lens, last, past: bool,
                      layer_fn: Callable | None = None):
        """A batch-1 chunk on static shapes: no past (causal, no mask) or whole blocks under a mask;
        ``layer_fn`` replaces each layer's call (the compiled layer)."""
        cfg, tokens = self.decoder.cfg, embeds.shape[1]
        if not past:
            empty = k_pool.new_empty(1, 0, *k_pool.shape[3:])
            mask, window = layer_masks(cfg, None, context_lens, 0, tokens)
            return self.decoder.run_layers(embeds, positions, lambda i: (empty, empty), mask, layer_fn, last=last,
                                           window_mask=window)
        slots, mask = whole_block_slots_and_mask(tables, context_lens, k_pool.shape[2], tokens)
        mask, window = layer_masks(cfg, mask, context_lens, slots.shape[1], tokens)
        return self.decoder.run_layers(embeds, positions, past_reader(k_pool, v_pool, slots), mask, layer_fn,
                                       last=last, window_mask=window)

    def _prefill(self, embeds, positions, k_pool, v_pool, tables, context_lens, width):
        """Replay (capturing first if new) the graph of this chunk's bucket; None when capture failed."""
        t = embeds.shape[1]
        past = bool(context_lens[0] > 0)  # a host tensor: no device sync
        key = (prefill_bucket(t), width if past else 0, positions.dim(), embeds.shape[-1])
        g = self._prefills.get(key)
        if g is None:
            if self.prefill_error is not None:
                return None
            g = self._capture_prefill(key, embeds, k_pool, v_pool)
            if g is None:
                return None
            self._prefills[key] = g
            while len(self._prefills) > self.prefill_graphs:
                self._prefills.popitem(last=False)
        self._prefills.move_to_end(key)
        g.embeds[:, :t].copy_(embeds)
        g.last.fill_(t - 1)
        self._load(g, positions, tables, context_lens)
        logits, new_k, new_v = g.replay()
        self.prefill_replays += 1
        return logits, new_k[:, :, :t], new_v[:, :, :t]

    def _capture_prefill(self, key, embeds, k_pool, v_pool) -> _PrefillGraph | None:
        tokens, width, rank, _ = key
        device = embeds.device
        buffers = dict(
            embeds=torch.zeros(1, tokens, embeds.shape[-1], dtype=embeds.dtype, device=device),
            # Padding positions stay as they are; they only steer the padding's own rows.
            positions=torch.zeros((3, 1, tokens) if rank == 3 else (1, tokens), dtype=torch.long, device=device),
            # A chunk with no past reads no table; its buffer takes any table the engine passes.
            tables=torch.zeros(1, width or self.width_buckets[-1], dtype=torch.long, device=device),
            context_lens=torch.zeros(1, dtype=torch.long, device=device),
            last=torch.zeros(1, dtype=torch.long, device=device))

        def run(layer_fn=None):
            return self._prefill_step(buffers["embeds"], buffers["positions"], k_pool, v_pool, buffers["tables"],
                                      buffers["context_lens"], buffers["last"], past=width > 0, layer_fn=layer_fn)

        if not k_pool.is_cuda:  # no graphs off the GPU: the same padded step, run eagerly (tests run it there)
            return _PrefillGraph(run, **buffers)
        while True:
            layer_fn = None if width else self._prompt_layer_fn
            try:
                warm_up(lambda: run(layer_fn), device)  # reads block 0 of the pool and writes nothing
                graph, outputs = capture_graph(lambda: run(layer_fn), self._pool)
                break
            except Exception as exc:  # noqa: BLE001 - a chunk that cannot be captured runs eagerly
                reason = f"{type(exc).__name__}: {exc}"[:500]
                if layer_fn is not None:  # the compiled layers failed: capture the layers as written
                    self._prompt_layer_fn = None
                    self.prompt_compile_error = reason
                    warnings.warn(f"compiled prompt layers failed, capturing eager layers: {reason}")
                    continue
                self.prefill_error = reason
                warnings.warn(f"prompt chunks run eagerly, capturing one failed: {self.prefill_error}")
                return None
        self._pool = graph.pool()
        self.captures += 1
        return _PrefillGraph(lambda: (graph.replay(), outputs)[1], **buffers)

    # --- bursts ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_burst(self, tokens, position_ids, k_pool, v_pool, block_tables, context_lens,
                     steps: int, sampling: BurstSampling | None = None) -> BurstTokens | None:
        """``steps`` decode steps from input ids ``tokens`` [B], K/V written into the pools, each
        step's ids chosen on the device by ``sampling`` (None: the argmax of every row).

        The block tables must already hold a slot for every step's token. Returns the chosen
        ids [B, steps] on their way to the host, or None when no graph covers this batch (the
        caller then decodes step by step).
        """
        b = tokens.shape[0]
        batch = bucket_for(b, self.batch_buckets)
        width = bucket_for(block_tables.shape[1], self.width_buckets)
        if batch is None or width is None:
            return None
        key = (batch, width, position_ids.dim(), None if sampling is None else sampling.kind)
        g = self._bursts.get(key) or self._capture_burst(key, k_pool, v_pool, sampling)
        device = g.tokens.device
        g.tokens.zero_()
        g.tokens[:b].copy_(tokens.to(device, non_blocking=True))
        g.positions.zero_()  # padding rows: a burst advances them only where valid
        self._load(g, position_ids, block_tables, context_lens)
        g.valid.zero_()
        g.valid[:b] = 1
        if g.sampling is not None:
            g.sampling.load(sampling)
        return self._replay_burst(key, b, steps)

    @torch.inference_mode()
    def continue_burst(self, k_pool, v_pool, block_tables, steps: int) -> BurstTokens | None:
        """``steps`` more steps for the rows of the last burst, from where it stopped: its last
        ids, positions, context lengths and sampler counters are still in the graph's buffers
        (the sampler's are shared by every width of a batch bucket), so this may be launched
        before that burst's ids are read. ``block_tables`` (the same rows) must hold a
        slot for every token of both. None when there is no burst to continue."""
        if self._last_burst is None:
            return None
        last_key, b = self._last_burst
        width = bucket_for(block_tables.shape[1], self.width_buckets)
        if width is None or block_tables.shape[0] != b:
            return None
        key = (last_key[0], width, *last_key[2:])
        prev = self._bursts[last_key]
        g = self._bursts.get(key) or self._capture_burst(key, k_pool, v_pool, None, prev.sampling)
        if g is not prev:  # a wider table: the state moves to that width's graph
            for name in ("tokens", "positions", "context_lens", "valid"):
                getattr(g, name).copy_(getattr(prev, name))
        g.tables.zero_()
        g.tables[:b, :block_tables.shape[1]].copy_(block_tables.to(g.tables.device, non_blocking=True))
        return self._replay_burst(key, b, steps)

    def _replay_burst(self, key, b: int, steps: int) -> BurstTokens:
        g = self._bursts[key]
        out = torch.empty(b, steps, dtype=torch.long, device=g.tokens.device)
        for i in range(steps):
            g.replay()
            out[:, i].copy_(g.tokens[:b])
        self.fused_replays += steps * (self._fused is not None)
        self._last_burst = (key, b)
        return BurstTokens(out)

    def _burst_step(self, tokens, positions, k_pool, v_pool, tables, context_lens, valid,
                    sampling: SamplingStep | None = None, write: bool = True) -> None:
        """One step on static buffers: embed, layers, K/V into the pool, the chosen ids back into ``tokens``.

        ``write=False`` (the warm-up before capture) leaves the pools and every buffer alone.
        """
        if self._fused is not None:  # the inputs in one kernel; the attention writes the new K/V itself
            ends = self._fused.ends
            x, cos, sin = ends.inputs(tokens, positions)
            logits, _, _ = self._fused.layers(x, cos, sin, k_pool, v_pool, tables, context_lens,
                                              valid if write else torch.zeros_like(valid))
            if sampling is None and ends.kernels:  # the argmax, and the valid rows moved on, in one kernel
                if write:
                    ends.choose(logits, tokens, positions, context_lens, valid)
                else:
                    ends.choose(logits, torch.empty_like(tokens))
                return
        else:
            embeds = self.decoder.embed_tokens(tokens)[:, None]
            logits, new_k, new_v = self._static_step(embeds, positions, k_pool, v_pool, tables, context_lens)
            self._write_new_kv(k_pool, v_pool, tables, context_lens, valid, new_k, new_v, write)
        if not write:
            _choose(logits, sampling, advance=False, valid=valid)  # warms the sampler's kernels too
            return
        tokens.copy_(_choose(logits, sampling, advance=True, valid=valid))
        positions.add_(valid.view(tokens.shape[0], 1))  # valid rows move one position on
        context_lens.add_(valid)

    @staticmethod
    def _write_new_kv(k_pool, v_pool, tables, context_lens, valid, new_k, new_v, write: bool) -> None:
        """Each valid row's new K/V at its slot ``context_lens``; with ``write=False`` only the slots are found."""
        block_size = k_pool.shape[2]
        # Padding rows write row 0's values at row 0's slot: duplicates of one write, never a
        # stray write into a block someone owns.
        rows = torch.arange(valid.shape[0], device=valid.device) * valid
        column = (context_lens // block_size).clamp(max=tables.shape[1] - 1)
        slots = (tables.gather(1, column[:, None])[:, 0] * block_size + context_lens % block_size)[rows]
        layers = k_pool.shape[0]
        if not write:
            return
        k_pool.view(layers, -1, *k_pool.shape[3:]).index_copy_(1, slots, new_k[:, rows, 0].to(k_pool.dtype))
        v_pool.view(layers, -1, *v_pool.shape[3:]).index_copy_(1, slots, new_v[:, rows, 0].to(v_pool.dtype))

    def _sampling_step(self, batch: int, sampling: BurstSampling | None) -> SamplingStep | None:
        """The sampler buffers of a batch bucket and kind, made once: every width's graph reads the same."""
        if sampling is None:
            return None
        key = (batch, sampling.kind)
        if key not in self._sampling:
            self._sampling[key] = sampling.static(batch, self.decoder.cfg.vocab_size, self.device)
        return self._sampling[key]

    def _capture_burst(self, key, k_pool, v_pool, sampling: BurstSampling | None,
                       step: SamplingStep | None = None) -> _BurstGraph:
        """The burst graph of ``key``, its sampler buffers ``step`` (or those of ``sampling``'s kind)."""
        batch, width, rank, _ = key
        device = k_pool.device
        step = step or self._sampling_step(batch, sampling)
        buffers = (torch.zeros(batch, dtype=torch.long, device=device),
                   torch.zeros((3, batch, 1) if rank == 3 else (batch, 1), dtype=torch.long, device=device),
                   torch.zeros(batch, width, dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))
        tokens, positions, tables, context_lens, valid = buffers
        if not k_pool.is_cuda:  # no graphs off the GPU: the same step, run eagerly
            g = _BurstGraph(lambda: self._burst_step(*buffers[:2], k_pool, v_pool, *buffers[2:], step), *buffers, step)
            self._bursts[key] = g
            return g
        # Warm-up without writing: the pools hold other sequences' K/V. (The capture itself
        # only records; nothing runs until a replay.)
        self._warm_up(lambda: self._burst_step(*buffers[:2], k_pool, v_pool, *buffers[2:], step, write=False), device)
        graph, _ = capture_graph(lambda: self._burst_step(tokens, positions, k_pool, v_pool, tables, context_lens,
                                                          valid, step), self._pool)
        self._pool = graph.pool()
        self.captures += 1
        g = _BurstGraph(graph.replay, tokens, positions, tables, context_lens, valid, step)
        self._bursts[key] = g
        return g


def _choose(logits: torch.Tensor, sampling: SamplingStep | None, advance: bool, valid: torch.Tensor) -> torch.Tensor:
    """[B] next ids: the argmax, or ``sampling``'s choice (its counters moved on only with ``advance``)."""
    if sampling is None:
        return logits.float().argmax(-1)
    if advance:
        return sampling.next_ids(logits.float(), valid)
    return sampling.choose(logits.float())
