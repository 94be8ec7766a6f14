"""The attention alone at 16 and 1 rows (1,088-position past, 2,048-position table), by where the pool's blocks lie:
a pool just the rows' size (the probe's), a pool of ~GB_EACH GB each for K and V with the rows' blocks at its start
(the engine's: layer-major, [layers, blocks, ...]), the same pool block-major ([blocks, layers, ...] in memory),
and the big layer-major pool with the rows' blocks scattered."""
import json, os, statistics
import torch
from edgeinfer.backends.torch.decode_attention import paged_attention
from edgeinfer.quant.kernels import graph_time_us
from edgeinfer.quant.launching import SplitWorkspace

L, H, KVH, HD, BS = 28, 12, 2, 128, 16
dev, dt = "cuda", torch.bfloat16
GB = float(os.environ.get("GB_EACH", "28"))
big = int(GB * 2**30 / (L * BS * KVH * HD * 2))
out = {"gpu": torch.cuda.get_device_name(), "load": os.getloadavg(), "big_blocks": big, "gb_each": GB}
def pool(blocks, block_major):
    if block_major:
        return torch.empty(blocks, L, BS, KVH, HD, dtype=dt, device=dev).transpose(0, 1)
    return torch.empty(L, blocks, BS, KVH, HD, dtype=dt, device=dev)
for rows in (16, 1):
    ctx, width = 1088, 2048
    nb = width // BS
    qkv = torch.randn(rows, (H + 2 * KVH) * HD, dtype=dt, device=dev)
    cos = torch.ones(rows, HD, dtype=dt, device=dev); sin = torch.zeros_like(cos)
    lens = torch.full((rows,), ctx, device=dev)
    valid = torch.ones(rows, dtype=torch.long, device=dev)
    ws = SplitWorkspace(torch.device(dev))
    res = {}
    for label, blocks, major, scatter in (("rows' pool", rows * nb, False, False), ("big, layer-major", big, False, False),
                                          ("big, block-major", big, True, False), ("rows' pool, block-major", rows * nb, True, False),
                                          ("big, layer-major, scattered", big, False, True)):
        k, v = pool(blocks, major), pool(blocks, major)
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randperm(blocks, generator=g)[: rows * nb] if scatter else torch.arange(rows * nb)
        tables = ids.to(dev).view(rows, nb)
        for t in (k, v):
            t[:, ids.to(dev)] = torch.randn(L, rows * nb, BS, KVH, HD, dtype=dt, device=dev)
        f = [lambda i=i: paged_attention(qkv, cos, sin, k[i], v[i], tables, lens, heads=H, kv_heads=KVH,
                                         head_dim=HD, valid=valid, workspace=ws) for i in range(L)]
        ref = f[0]().float().sum().item()
        runs = [round(graph_time_us(f, repeats=20), 2) for _ in range(5)]
        res[label] = {"median_us": statistics.median(runs), "runs": runs, "checksum": ref}
        print(rows, label, statistics.median(runs), ref, flush=True)
        del k, v, f; torch.cuda.empty_cache()
    out[f"rows {rows}"] = res
out["load_after"] = os.getloadavg()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "attention-pool.json"), "w"), indent=1)
