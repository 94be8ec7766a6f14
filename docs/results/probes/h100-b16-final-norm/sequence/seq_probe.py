"""Batch 16 as the step runs it around the attention: 28 layers of [q|k|v staged product (norm, bias) -> attention ->
o staged product (residual)], one CUDA graph, dependent launches as the step has them; the attention's tiling varied.
Also the two products without the attention, and the attention alone, 28 in a graph."""
import dataclasses, json, os, statistics
import torch
from edgeinfer.backends.torch.decode_attention import TILING, paged_attention
from edgeinfer.quant import staged
from edgeinfer.quant.kernels import graph_time_us
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.products import fused_inputs, random_packed

L, H, KVH, HD, BS, ROWS, CTX, WIDTH = 28, 12, 2, 128, 16, 16, 1088, 2048
dev, dt = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)
wq = [random_packed(2048, 1536, 4, 128, dev) for _ in range(L)]
wo = [random_packed(1536, 1536, 4, 128, dev) for _ in range(L)]
x, kq = fused_inputs("norm+bias", 2048, 1536, dev, rows=ROWS)
_, ko = fused_inputs("residual", 1536, 1536, dev, rows=ROWS)
tq, to = staged.StagedGemvConfig(4, 3), staged.StagedGemvConfig(4, 3)
nb = WIDTH // BS
k_pool = torch.randn(L, ROWS * nb, BS, KVH, HD, dtype=dt, device=dev); v_pool = torch.randn_like(k_pool)
cos = torch.ones(ROWS, HD, dtype=dt, device=dev); sin = torch.zeros_like(cos)
tables = torch.arange(ROWS * nb, device=dev).view(ROWS, nb)
lens = torch.full((ROWS,), CTX, device=dev); valid = torch.ones(ROWS, dtype=torch.long, device=dev)
wsq, wsa, wso = SplitWorkspace(dev), SplitWorkspace(dev), SplitWorkspace(dev)
qkv_out = torch.empty(ROWS, 2048, dtype=dt, device=dev); o_out = torch.empty(ROWS, 1536, dtype=dt, device=dev)
tilings = {"default": TILING, "168 registers": dataclasses.replace(TILING, registers=168),
           "256 programs": dataclasses.replace(TILING, programs=256), "8 warps": dataclasses.replace(TILING, warps=8),
           "128 registers": dataclasses.replace(TILING, registers=128)}
def layer(i, tiling, attention=True, products=True):
    def f():
        q = staged.staged_mm(x, wq[i], tq, out=qkv_out, workspace=wsq, **kq) if products else qkv_out
        a = paged_attention(q, cos, sin, k_pool[i], v_pool[i], tables, lens, heads=H, kv_heads=KVH, head_dim=HD,
                            valid=valid, workspace=wsa, tiling=tiling) if attention else q[:, :1536].contiguous()
        if products:
            staged.staged_mm(a, wo[i], to, out=o_out, workspace=wso, **ko)
    return f
out = {"gpu": torch.cuda.get_device_name(), "load": os.getloadavg(), "us_a_layer": {}}
cases = {f"layers, {n}": (t, True, True) for n, t in tilings.items()}
cases.update({f"attention alone, {n}": (t, True, False) for n, t in tilings.items()})
cases["products alone (a copy between)"] = (TILING, False, True)
times = {c: [] for c in cases}
for c, (t, a, p) in cases.items():  # compile and check once
    layer(0, t, a, p)()
torch.cuda.synchronize()
for _ in range(5):
    for c, (t, a, p) in cases.items():
        times[c].append(graph_time_us([layer(i, t, a, p) for i in range(L)], repeats=20))
for c, v in times.items():
    out["us_a_layer"][c] = {"median": round(statistics.median(v), 2), "runs": [round(u, 2) for u in v]}
    print(c, round(statistics.median(v), 2), flush=True)
out["load_after"] = os.getloadavg()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "sequence.json"), "w"), indent=1)
