"""gate|up at 16 rows with its fusions (4 warps, whole): HEAD's staged kernel against the x-shared variant (two chunks
ahead), as it compiles and with its registers capped at 160 (three programs an SM, as HEAD's 155 allow)."""
import importlib.util, json, os, statistics, sys
import torch
from edgeinfer.quant import launching, staged
from edgeinfer.quant.kernels import cold_copies, graph_time_us
from edgeinfer.quant.packed import PackedMatrix
from edgeinfer.testing.products import fused_inputs, random_packed

spec = importlib.util.spec_from_file_location("v3_staged", os.path.join(os.path.dirname(__file__), "v3_staged.py"))
v3 = importlib.util.module_from_spec(spec); sys.modules["v3_staged"] = v3; spec.loader.exec_module(v3)
cap = {"on": None}
v3.launch = lambda k, g, w, *a, **kw: launching.launch(k, g, w, *a, **({"maxnreg": cap["on"]} if cap["on"] else {}), **kw)
dev = torch.device("cuda"); torch.manual_seed(0)
n, k = 17920, 1536
w = random_packed(n, k, 4, 128, dev)
copies = [w] + [PackedMatrix(w.codes.clone(), w.scales.clone(), None, 4, 128, (n, k))
                for _ in range(cold_copies(w.nbytes, torch.cuda.get_device_properties(dev).L2_cache_size) - 1)]
x, kw = fused_inputs("norm+glu", n, k, dev, rows=16)
space = launching.SplitWorkspace(dev)
head_tile, v3_tile = staged.StagedGemvConfig(4, 1), v3.StagedGemvConfig(4, 1)
def v3_call(c, regs):
    cap["on"] = regs
    return v3.staged_mm(x, c, v3_tile, workspace=space, **kw)
ref = staged.staged_mm(x, w, head_tile, workspace=space, **kw)
same = {"variant": torch.equal(ref, v3_call(w, None)), "variant, 160 registers": torch.equal(ref, v3_call(w, 160)), "variant, 168 registers": torch.equal(ref, v3_call(w, 168))}
fns = {"HEAD": [lambda c=c: staged.staged_mm(x, c, head_tile, workspace=space, **kw) for c in copies],
       "variant": [lambda c=c: v3_call(c, None) for c in copies],
       "variant, 160 registers": [lambda c=c: v3_call(c, 160) for c in copies],
       "variant, 168 registers": [lambda c=c: v3_call(c, 168) for c in copies]}
times = {l: [] for l in fns}
for _ in range(7):
    for l, f in fns.items():
        times[l].append(graph_time_us(f))
out = {"gpu": torch.cuda.get_device_name(), "load": os.getloadavg(), "same_outputs_as_head": same,
       "us": {l: round(statistics.median(t), 2) for l, t in times.items()}, "runs": times}
print(json.dumps(out)); json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "cap.json"), "w"), indent=1)
