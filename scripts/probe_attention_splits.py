"""Diagnostic probe (not a benchmark): the batch-1 paged attention of a Qwen2-VL-2B layer (12
heads, 2 KV heads, head 128) by the row's past (1,024 and 256 positions), the block table's width
(1,040, 2,048 and 4,096 positions: the decode graphs bucket widths by powers of two) and
``ATTENTION_PROGRAMS`` (which sets the splits).

    python scripts/probe_attention_splits.py > OUT.jsonl      # PROBE_P=1024 for the default only

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
    for ctx in (1024, 256):
        for width in (1040, 2048, 4096):
            blocks = width // BS
            k_pool = torch.randn(L, blocks, BS, KVH, HD, dtype=dt, device=dev)
            v_pool = torch.randn_like(k_pool)
            qkv = torch.randn(1, (H + 2 * KVH) * HD, dtype=dt, device=dev)
            cos = torch.ones(1, HD, dtype=dt, device=dev)
            sin = torch.zeros_like(cos)
            tables = torch.arange(blocks, device=dev)[None]
            lens = torch.tensor([ctx], device=dev)
            valid = torch.zeros(1, dtype=torch.long, device=dev)  # no valid row: the pool is not written
            ws = SplitWorkspace(torch.device(dev))

            def attention(i):
                return td.paged_attention(qkv, cos, sin, k_pool[i], v_pool[i], tables, lens, heads=H, kv_heads=KVH,
                                          head_dim=HD, valid=valid, workspace=ws)
            row, ref = {"context": ctx, "table_positions": width}, None
            for p in programs:
                td.ATTENTION_PROGRAMS = p
                chunk = td.attention_chunk(1, KVH, width)
                out = attention(0).float()
                ref = out if ref is None else ref
                us = min(graph_time_us([lambda i=i: attention(i) for i in range(L)], repeats=20) for _ in range(3))
                row[f"P{p}"] = {"splits": -(-width // chunk), "chunk": chunk, "us": round(us, 2),
                                "max_err": (out - ref).abs().max().item()}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
