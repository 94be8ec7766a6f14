"""Decode steps replayed from CUDA graphs.

At batch 1 a decode step of a small model is hundreds of short kernels; launched one by
one from Python they cost more than the memory traffic they do. The step is captured
once per (batch bucket, block-table width bucket) and replayed: inputs are copied into
the graph's static buffers, padding rows get ``context_lens = 0`` (they attend to
themselves only and their outputs are dropped), and the past is read through whole
blocks under a mask so no shape depends on the context length.

Prefill (T > 1) runs eagerly: its shapes change with every prompt.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from edgeinfer.backends.torch_backend import TorchDecoderEngine
from edgeinfer.models.decoder import Decoder, DecoderLayer, gather_past, whole_block_slots_and_mask


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from ``start`` up to the first one >= ``limit``."""
    out = [start]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


def bucket_for(value: int, choices: list[int]) -> int | None:
    return next((c for c in choices if c >= value), None)


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


class CudaGraphDecoderEngine(TorchDecoderEngine):
    """The torch decoder engine with decode steps captured in CUDA graphs."""

    def __init__(self, decoder: Decoder, max_batch_size: int, max_blocks: int, compile_layers: bool = True) -> None:
        super().__init__(decoder)
        self.batch_buckets = buckets(max_batch_size)
        self.width_buckets = buckets(max_blocks, start=8)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._pool = None  # graphs share one memory pool
        self.captures = 0
        # A layer is a few dozen small kernels (norms, RoPE, residuals); compiled, they fuse.
        # Every layer has the same code and shapes, so one compilation serves all of them.
        self._layer_fn = torch.compile(DecoderLayer.forward, dynamic=False, fullgraph=True) if compile_layers else None
        self.compile_error: str | None = None

    def _static_step(self, embeds, positions, k_pool, v_pool, tables, context_lens):
        slots, mask = whole_block_slots_and_mask(tables, context_lens, k_pool.shape[2], 1)

        def read_past(i: int):
            return gather_past(k_pool[i], slots), gather_past(v_pool[i], slots)

        return self.decoder.run_layers(embeds, positions, read_past, mask, self._layer_fn)

    @torch.inference_mode()
    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens):
        b, t, _ = inputs_embeds.shape
        batch = bucket_for(b, self.batch_buckets)
        width = bucket_for(block_tables.shape[1], self.width_buckets)
        if t != 1 or batch is None or width is None or not inputs_embeds.is_cuda:
            return super().step(inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens)
        key = (batch, width, position_ids.dim())
        g = self._graphs.get(key) or self._capture(key, inputs_embeds, position_ids, k_pool, v_pool)
        self._load(g, inputs_embeds, position_ids, block_tables, context_lens)
        g.graph.replay()
        return g.logits[:b], g.new_k[:, :b], g.new_v[:, :b]

    def _load(self, g: _Graph, embeds, positions, tables, context_lens) -> None:
        b, width = tables.shape
        g.embeds[:b].copy_(embeds)
        g.positions[..., :b, :].copy_(positions.to(g.positions.device))
        g.tables.zero_()
        g.tables[:b, :width].copy_(tables.to(g.tables.device))
        g.context_lens.zero_()
        g.context_lens[:b].copy_(context_lens.to(g.context_lens.device))

    def _capture(self, key, embeds, positions, k_pool, v_pool) -> _Graph:
        batch, width, rank = key
        device = embeds.device
        static_embeds = torch.zeros(batch, 1, embeds.shape[-1], dtype=embeds.dtype, device=device)
        pos_shape = (3, batch, 1) if rank == 3 else (batch, 1)
        static_positions = torch.zeros(pos_shape, dtype=torch.long, device=device)
        tables = torch.zeros(batch, width, dtype=torch.long, device=device)
        context_lens = torch.zeros(batch, dtype=torch.long, device=device)
        args = (static_embeds, static_positions, k_pool, v_pool, tables, context_lens)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            try:
                for _ in range(2):  # warm-up (and compilation) outside the capture
                    self._static_step(*args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to eager layers
                if self._layer_fn is None:
                    raise
                self.compile_error = f"{type(exc).__name__}: {exc}"[:500]
                warnings.warn(f"compiled decoder layers failed, capturing eager layers: {self.compile_error}")
                self._layer_fn = None
                for _ in range(2):
                    self._static_step(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, new_k, new_v = self._static_step(*args)
        self._pool = graph.pool()
        self.captures += 1
        g = _Graph(graph, static_embeds, static_positions, tables, context_lens, logits, new_k, new_v)
        self._graphs[key] = g
        return g
