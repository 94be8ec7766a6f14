"""16 rows' attention alone, as the step's contexts are (1,088 past in a 2,048-position table): the probe's
pools (nothing written) against the pool written at each row's slot, as the step does."""
import json, os, statistics
import torch
from edgeinfer.backends.torch.decode_attention import TILING, paged_attention
from edgeinfer.quant.kernels import graph_time_us
from edgeinfer.quant.launching import SplitWorkspace

L, H, KVH, HD, BS = 28, 12, 2, 128, 16
dev, dt = "cuda", torch.bfloat16
out = {"gpu": torch.cuda.get_device_name(), "load": os.getloadavg(), "tiling": str(TILING)}
for rows in (16, 1):
    for ctx, width in ((1088, 2048), (1024, 2048), (1088, 1088)):
        blocks = width // BS
        k_pool = torch.randn(L, rows * blocks, BS, KVH, HD, dtype=dt, device=dev)
        v_pool = torch.randn_like(k_pool)
        qkv = torch.randn(rows, (H + 2 * KVH) * HD, dtype=dt, device=dev)
        cos = torch.ones(rows, HD, dtype=dt, device=dev); sin = torch.zeros_like(cos)
        tables = torch.arange(rows * blocks, device=dev).view(rows, blocks)
        lens = torch.full((rows,), ctx, device=dev)
        ws = SplitWorkspace(torch.device(dev))
        res = {}
        for label, valid in (("nothing written", torch.zeros(rows, dtype=torch.long, device=dev)),
                             ("written", torch.ones(rows, dtype=torch.long, device=dev))):
            f = [lambda i=i: paged_attention(qkv, cos, sin, k_pool[i], v_pool[i], tables, lens, heads=H, kv_heads=KVH,
                                             head_dim=HD, valid=valid, workspace=ws) for i in range(L)]
            res[label] = [round(graph_time_us(f, repeats=20), 2) for _ in range(5)]
        out[f"rows {rows}, past {ctx}, table {width}"] = {k: {"median_us": statistics.median(v), "runs": v} for k, v in res.items()}
        print(rows, ctx, width, {k: statistics.median(v) for k, v in res.items()}, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "attention.json"), "w"), indent=1)
