"""Attention alone, this tree's default tiling: 28 Qwen2-VL-2B layers' pools in one CUDA graph, each row its own
pages, 1,024-position past in a 2,048-position table; median of 5 timings of 20 replays. Works on trees before
and after the attention moved to decode_attention.py (the same timing code for both)."""
import json, os, statistics, sys
import torch
try:
    from edgeinfer.backends.torch.decode_attention import paged_attention
except ImportError:
    from edgeinfer.backends.torch.triton_decode import paged_attention
from edgeinfer.quant.kernels import graph_time_us
from edgeinfer.quant.launching import SplitWorkspace

L, H, KVH, HD, BS = 28, 12, 2, 128, 16
label = sys.argv[1]
for rows in (1, 4, 16):
    dev, dt, ctx, width = "cuda", torch.bfloat16, 1024, 2048
    blocks = width // BS
    torch.manual_seed(0)
    k_pool = torch.randn(L, rows * blocks, BS, KVH, HD, dtype=dt, device=dev)
    v_pool = torch.randn_like(k_pool)
    qkv = torch.randn(rows, (H + 2 * KVH) * HD, dtype=dt, device=dev)
    cos = torch.ones(rows, HD, dtype=dt, device=dev); sin = torch.zeros_like(cos)
    tables = torch.arange(rows * blocks, device=dev).view(rows, blocks)
    lens = torch.full((rows,), ctx, device=dev)
    valid = torch.zeros(rows, dtype=torch.long, device=dev)
    ws = SplitWorkspace(torch.device(dev))
    f = lambda i: paged_attention(qkv, cos, sin, k_pool[i], v_pool[i], tables, lens, heads=H, kv_heads=KVH,
                                  head_dim=HD, valid=valid, workspace=ws)
    out = f(0).float()
    times = [graph_time_us([lambda i=i: f(i) for i in range(L)], repeats=20) for _ in range(5)]  # per call
    print(json.dumps({"tree": label, "rows": rows, "us_a_layer": round(statistics.median(times), 3),
                      "all": [round(t, 3) for t in times], "checksum": round(out.abs().sum().item(), 2),
                      "load": os.getloadavg()[0]}), flush=True)
