"""Reduce probe_chain_trace.py's raw timestamps (chain-trace-raw.pt) to each kernel's quantiles, µs after the
kernel before it ended: its programs' starts, their waits' returns and their ends (every kernel of every layer)."""
import json
import sys

import torch

raw = torch.load(sys.argv[1])
qs = (0.0, 0.1, 0.5, 0.9, 1.0)
out = {}
for label, ks in raw.items():
    rows = []
    for i, k in enumerate(ks):
        prev_end = int(ks[i - 1]["end"].max()) if i else int(k["start"].min())
        row = {"name": k["name"], "programs": len(k["start"])}
        for f in ("start", "released", "end"):
            v = (k[f] - prev_end).double() / 1e3
            row[f] = [round(float(torch.quantile(v, q)), 3) for q in qs]
        rows.append(row)
    out[label] = rows
json.dump({"quantiles": qs, "us_after_the_kernel_before_ended": out}, open(sys.argv[2], "w"), indent=0)
