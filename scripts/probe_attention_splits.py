"""Diagnostic probe (not a benchmark): the paged attention of a Qwen2-VL-2B layer (12 heads, 2 KV
heads, head 128) for ``PROBE_ROWS`` rows (a list; 1 unless given) by each row's past
(``PROBE_CONTEXTS``: 1,024 and 256 positions unless given), the block table's width
(``PROBE_WIDTHS``: 1,040, 2,048 and 4,096 positions unless given; the decode graphs bucket widths
by powers of two), and the tiling (:class:`AttentionTiling`, the default's unless given): the
programs aimed at (``PROBE_P``, which sets the splits), the merge's values (``PROBE_MERGE``, which
set the splits it takes at a time), the positions a step reads (``PROBE_TILES``; the fewest a split
takes follows it), the warps (``PROBE_WARPS``) and the cap on registers a thread
(``PROBE_REGISTERS``, ``none`` for the compiler's choice). Each row reads its own pages.

    python scripts/probe_attention_splits.py > OUT.jsonl      # PROBE_P=1024 for the default only
    PROBE_MERGE=4096,16384 python scripts/probe_attention_splits.py    # keys then P<p>/M<values>

28 layers' pools back to back from one CUDA graph, dependent launches on, the median of three
timings of 20 replays (the raw files the docs cite so far took the best of three);
``max_err`` against the first setting's output. Those files:
docs/results/probes/h200-attention-splits-*.jsonl, h200-attention-steps-own-pages.jsonl."""
import itertools
import json
import os
import statistics

import torch

from edgeinfer.backends.torch.decode_attention import TILING, AttentionTiling, paged_attention
from edgeinfer.quant.kernels import graph_time_us
from edgeinfer.quant.launching import SplitWorkspace

L, H, KVH, HD, BS = 28, 12, 2, 128, 16


def main() -> None:
    merges = [int(v) for v in os.environ.get("PROBE_MERGE", str(TILING.merge_values)).split(",")]
    tiles = [int(v) for v in os.environ.get("PROBE_TILES", str(TILING.tile)).split(",")]
    warp_counts = [int(v) for v in os.environ.get("PROBE_WARPS", str(TILING.warps)).split(",")]
    caps = [None if v == "none" else int(v) for v in os.environ.get("PROBE_REGISTERS", "none").split(",")]
    programs = [int(v) for v in os.environ.get("PROBE_P", "1024,256,128,64,32,16,8,4,2").split(",")]
    for rows in [int(v) for v in os.environ.get("PROBE_ROWS", "1").split(",")]:
        probe(rows, programs, merges, tiles, warp_counts, caps)


def probe(rows: int, programs: list[int], merges: list[int], tiles: list[int], warp_counts: list[int],
          caps: list[int | None]) -> None:
    dev, dt = "cuda", torch.bfloat16
    for ctx in [int(v) for v in os.environ.get("PROBE_CONTEXTS", "1024,256").split(",")]:
        for width in [int(v) for v in os.environ.get("PROBE_WIDTHS", "1040,2048,4096").split(",")]:
            blocks = width // BS
            # Each row its own pages, as each request has its own past (rows reading the same pages
            # would find them in L2 and time a bandwidth no batch of requests gets).
            k_pool = torch.randn(L, rows * blocks, BS, KVH, HD, dtype=dt, device=dev)
            v_pool = torch.randn_like(k_pool)
            qkv = torch.randn(rows, (H + 2 * KVH) * HD, dtype=dt, device=dev)
            cos = torch.ones(rows, HD, dtype=dt, device=dev)
            sin = torch.zeros_like(cos)
            tables = torch.arange(rows * blocks, device=dev).view(rows, blocks)
            lens = torch.full((rows,), ctx, device=dev)
            valid = torch.zeros(rows, dtype=torch.long, device=dev)  # no valid row: the pool is not written
            ws = SplitWorkspace(torch.device(dev))

            def attention(i, tiling):
                return paged_attention(qkv, cos, sin, k_pool[i], v_pool[i], tables, lens, heads=H, kv_heads=KVH,
                                       head_dim=HD, valid=valid, workspace=ws, tiling=tiling)
            row, ref = {"rows": rows, "context": ctx, "table_positions": width}, None
            for p, merge, tile, warps, cap in itertools.product(programs, merges, tiles, warp_counts, caps):
                tiling = AttentionTiling(tile=tile, chunk=tile, programs=p, merge_values=merge, warps=warps,
                                         registers=cap)
                chunk = tiling.chunk_for(rows, KVH, width)
                out = attention(0, tiling).float()
                ref = out if ref is None else ref
                us = statistics.median(graph_time_us([lambda i=i: attention(i, tiling) for i in range(L)], repeats=20)
                                       for _ in range(3))
                key = f"P{p}" + (f"/M{merge}" if len(merges) > 1 else "") + (f"/T{tile}" if len(tiles) > 1 else "") \
                    + (f"/{warps}w" if len(warp_counts) > 1 else "") + (f"/r{cap}" if len(caps) > 1 else "")
                row[key] = {"splits": -(-width // chunk), "chunk": chunk, "us": round(us, 2),
                            "max_err": (out - ref).abs().max().item()}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
