"""Diagnostic probe (not a benchmark): the paged attention of a Qwen2-VL-2B layer (12 heads, 2 KV
heads, head 128) for ``PROBE_ROWS`` rows (1 unless given) by each row's past (1,024 and 256
positions), the block table's width (1,040, 2,048 and 4,096 positions: the decode graphs bucket
widths by powers of two), ``ATTENTION_PROGRAMS`` (which sets the splits) and ``MERGE_VALUES``
(which sets the splits the merge takes at a time).

    python scripts/probe_attention_splits.py > OUT.jsonl      # PROBE_P=1024 for the default only
    PROBE_MERGE=4096,16384 python scripts/probe_attention_splits.py    # keys then P<p>/M<values>

28 layers' pools back to back from one CUDA graph, dependent launches on, best of three timings
of 20 replays; ``max_err`` against the default's output. Outputs of the runs the docs cite:
docs/results/probes/h200-attention-splits-*.jsonl."""
import json
import os

import torch

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant.kernels import SplitWorkspace, graph_time_us

L, H, KVH, HD, BS = 28, 12, 2, 128, 16


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    programs = [int(v) for v in os.environ.get("PROBE_P", "1024,256,128,64,32,16,8,4,2").split(",")]
    rows = int(os.environ.get("PROBE_ROWS", "1"))
    merges = [int(v) for v in os.environ.get("PROBE_MERGE", str(td.MERGE_VALUES)).split(",")]
    for ctx in (1024, 256):
        for width in (1040, 2048, 4096):
            blocks = width // BS
            k_pool = torch.randn(L, blocks, BS, KVH, HD, dtype=dt, device=dev)
            v_pool = torch.randn_like(k_pool)
            qkv = torch.randn(rows, (H + 2 * KVH) * HD, dtype=dt, device=dev)
            cos = torch.ones(rows, HD, dtype=dt, device=dev)
            sin = torch.zeros_like(cos)
            tables = torch.arange(blocks, device=dev)[None].repeat(rows, 1)  # rows read one past: none is written
            lens = torch.full((rows,), ctx, device=dev)
            valid = torch.zeros(rows, dtype=torch.long, device=dev)  # no valid row: the pool is not written
            ws = SplitWorkspace(torch.device(dev))

            def attention(i):
                return td.paged_attention(qkv, cos, sin, k_pool[i], v_pool[i], tables, lens, heads=H, kv_heads=KVH,
                                          head_dim=HD, valid=valid, workspace=ws)
            row, ref = {"rows": rows, "context": ctx, "table_positions": width}, None
            for p in programs:
                for merge in merges:
                    td.ATTENTION_PROGRAMS, td.MERGE_VALUES = p, merge
                    chunk = td.attention_chunk(rows, KVH, width)
                    out = attention(0).float()
                    ref = out if ref is None else ref
                    us = min(graph_time_us([lambda i=i: attention(i) for i in range(L)], repeats=20) for _ in range(3))
                    key = f"P{p}" if len(merges) == 1 else f"P{p}/M{merge}"
                    row[key] = {"splits": -(-width // chunk), "chunk": chunk, "us": round(us, 2),
                                "max_err": (out - ref).abs().max().item()}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
