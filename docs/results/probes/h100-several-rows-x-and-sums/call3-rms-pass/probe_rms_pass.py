"""What the rows' RMS pass costs the staged product at 16 rows: the fused product as it runs, the same with
the RMS pass's loads left out (KC=0: wrong values, same everything else), and without the norm at all."""
import json, os, statistics
import torch
from edgeinfer.quant import staged
from edgeinfer.quant.kernels import cold_copies, graph_time_us
from edgeinfer.quant.launching import SplitWorkspace, launch, launch_options, pow2
from edgeinfer.quant.packed import PackedMatrix
from edgeinfer.testing.products import fused_inputs, random_packed

dev = torch.device("cuda"); torch.manual_seed(0)
space = SplitWorkspace(dev)
l2 = torch.cuda.get_device_properties(dev).L2_cache_size

def call(x, w, cfg, y, kc, norm_weight, eps, bias, glu):
    m, (n, k) = x.shape[0], (w.layout.n, w.layout.k)
    chunks = k // 128 // cfg.split
    tiles = n // (16 * cfg.warps)
    parts, arrivals = space.take(cfg.split * 16 * n, tiles) if cfg.split > 1 else (y, y)
    codes = w.codes
    launch(staged._staged_gemv_kernel, (tiles, cfg.split), False, x, codes, w.scales, w.scales,
           bias if bias is not None else codes, codes, norm_weight if norm_weight is not None else codes, y, parts,
           arrivals, n, k, k // 8, w.layout.groups, eps, m, GPS=chunks, XP=pow2(chunks), NW=cfg.warps, SPLIT=cfg.split,
           EARLY=chunks, GS=w.layout.group_constexpr, XB=min(pow2(k), 2048), PROLOGUE=norm_weight is not None,
           HAS_BIAS=bias is not None, HAS_RES=False, HAS_Z=False, GLU=glu, BF16=True, MP=16, KC=kc,
           **launch_options(x.device), num_warps=cfg.warps)

out = {"gpu": torch.cuda.get_device_name(), "load_before": os.getloadavg()}
for name, n, k, kind, cfg in (("gate_up", 17920, 1536, "norm+glu", staged.StagedGemvConfig(4, 1)),
                              ("qkv", 2048, 1536, "norm+bias", staged.StagedGemvConfig(4, 3))):
    w = random_packed(n, k, 4, 128, dev)
    copies = [w] + [PackedMatrix(w.codes.clone(), w.scales.clone(), None, 4, 128, (n, k)) for _ in range(cold_copies(w.nbytes, l2) - 1)]
    x, kw = fused_inputs(kind, n, k, dev, rows=16)
    glu = bool(kw.get("glu"))
    y = torch.empty(16, n // 2 if glu else n, dtype=x.dtype, device=dev)
    nw, eps, bias = kw.get("norm_weight"), kw.get("eps", 0.0), kw.get("bias")
    ref = staged.staged_mm(x, w, cfg, workspace=space, **kw)
    call(x, w, cfg, y, k // 128, nw, eps, bias, glu); torch.cuda.synchronize()
    same = torch.equal(ref, y)
    variants = {"as it runs": k // 128, "RMS loads left out (KC=0)": 0, "no norm": None}
    fns = {label: [lambda c=c, kc=kc: call(x, c, cfg, y, kc or 0, nw if kc is not None else None, eps, bias, glu) for c in copies]
           for label, kc in variants.items()}
    times = {label: [] for label in fns}
    for _ in range(5):
        for label, f in fns.items():
            times[label].append(graph_time_us(f))
    out[name] = {"tile": str(cfg), "same_as_staged_mm": same, "us": {l: round(statistics.median(t), 2) for l, t in times.items()},
                 "runs": times}
    print(name, out[name]["us"], same, flush=True)
out["load_after"] = os.getloadavg()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "kc0.json"), "w"), indent=1)
