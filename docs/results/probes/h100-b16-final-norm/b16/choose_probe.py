"""The greedy choice alone at 1 and 16 rows of Qwen2-VL's 151,936 bf16 logits, by the logits a program reads."""
import json, os, statistics
import torch
from edgeinfer.backends.torch import step_ends
from edgeinfer.quant.kernels import graph_time_us
from edgeinfer.quant.launching import SplitWorkspace
dev = torch.device("cuda"); out = {"gpu": torch.cuda.get_device_name(), "load": os.getloadavg()}
for rows in (1, 16):
    logits = [torch.randn(rows, 151936, dtype=torch.bfloat16, device=dev) for _ in range(24)]
    ids = torch.zeros(rows, dtype=torch.long, device=dev); ws = SplitWorkspace(dev)
    times = {b: [] for b in (2048, 4096, 8192, 16384)}
    for _ in range(5):
        for b in times:
            step_ends.ARGMAX_BLOCK = b
            fns = [lambda l=l: step_ends.choose_greedy(l, ids, ws) for l in logits]
            times[b].append(graph_time_us(fns, repeats=20))
            assert ids.tolist() == logits[-1].argmax(-1).tolist()
    out[f"rows {rows}"] = {b: {"median_us": round(statistics.median(t), 2), "runs": [round(u, 2) for u in t]} for b, t in times.items()}
    print(rows, {b: round(statistics.median(t), 2) for b, t in times.items()}, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "choose.json"), "w"), indent=1)
