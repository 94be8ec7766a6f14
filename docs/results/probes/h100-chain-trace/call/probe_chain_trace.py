"""Diagnostic probe (not a benchmark), run from the trace copy of the kernels (trace.diff): a layer's four 4-bit
products in the batch-1 step's order over 28 layers, every program's start, the moment its wait for the kernels
before it returned, and its end (%globaltimer, ns), for the chain on packed_gemv's fastest tiles alone and on
the staged kernel's; and gate|up's and down's 28 copies alone, as the tuner times a tile.

    OUT=folder python probe_chain_trace.py

Per kernel of the chain (each layer's product; the first and last layers left out), in µs, medians over layers:
- launch_lead: its first program's start before the kernel before it ended (positive: it started early);
- early_programs: the share of its programs that started before the kernel before it ended;
- release: its first program's wait returning, after the kernel before it ended;
- after_release: its last program's end after its first wait returned (what it adds to the chain);
- span: its last program's end after the kernel before it ended.
Writes $OUT/probe-chain-trace.json (load averages before and after) and the raw timestamps,
$OUT/chain-trace-raw.pt.
"""
import json
import os
import statistics

import torch
import triton

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels, launching, staged
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.products import QWEN2_VL_2B, fused_inputs, layer_calls, random_packed, right_one_row_tiles

LAYERS, GS = 28, 128


def traced(calls, programs_max, dev):
    """Capture ``calls`` in a graph with each launch's slice of a trace, replay it, and return the trace."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    launching.TRACE = trace = launching.Trace(programs_max, dev)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
    finally:
        launching.TRACE = None
    us = kernels.replay_ms(graph, 10) / len(calls) * 1e3
    graph.replay()
    torch.cuda.synchronize()
    return trace, us


def anatomy(trace, skip_first=1):
    buf = trace.buf.view(-1, 4).cpu()
    kernels_ = []
    for name, off, n in trace.launches:
        b = buf[off:off + n]
        kernels_.append({"name": name, "start": b[:, 0], "released": b[:, 1], "end": b[:, 2], "sm": b[:, 3]})
    rows = []
    for i in range(skip_first, len(kernels_)):
        k, prev = kernels_[i], kernels_[i - 1]
        prev_end = int(prev["end"].max())
        rows.append({"name": k["name"], "programs": len(k["start"]),
                     "launch_lead": (prev_end - int(k["start"].min())) / 1e3,
                     "early_programs": float((k["start"] < prev_end).float().mean()),
                     "release": (int(k["released"].min()) - prev_end) / 1e3,
                     "release_spread": (int(k["released"].max()) - int(k["released"].min())) / 1e3,
                     "after_release": (int(k["end"].max()) - int(k["released"].min())) / 1e3,
                     "span": (int(k["end"].max()) - prev_end) / 1e3,
                     "program_us": float((k["end"] - k["start"]).float().median()) / 1e3,
                     "sms": int(k["sm"].unique().numel())})
    return rows, kernels_


def summary(rows, period):
    out = {}
    for j in range(period):
        sel = [r for i, r in enumerate(rows) if i % period == j][:-1] or [r for i, r in enumerate(rows) if i % period == j]
        out[f"{j}:{sel[0]['name']}"] = {k: round(statistics.median(r[k] for r in sel), 3)
                                        for k in sel[0] if k not in ("name",)}
    return out


def main():
    dev = torch.device("cuda")
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "loadavg_before": os.getloadavg(), "products": {}, "chains": {}, "alone": {}}
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    calls, raw = {}, {}
    for name, n, k, kind in QWEN2_VL_2B:
        x, kw = fused_inputs(kind, n, k, dev)
        ws = [random_packed(n, k, 4, GS, dev) for _ in range(LAYERS)]
        outs = [torch.empty(1, n // 2 if kw.get("glu") else n, dtype=x.dtype, device=dev) for _ in range(LAYERS)]
        tiles = td.PACKED_GEMV_CANDIDATES + tuple(staged.tiles_that_fit(ws[0], x.dtype, kw.get("glu", False)))
        kernels.compile_ahead([f for t in tiles for f in layer_calls(x, ws[:1], t, outs, space, warmup=True, **kw)])
        right, wrong = right_one_row_tiles(x, ws[0], tiles, outs[0], space, **kw)
        alone = {t: kernels.graph_time_us(layer_calls(x, ws, t, outs, space, **kw), 10) for t in right}
        calls[name] = {}
        entry = {"wrong": wrong}
        for kind_name, cls in (("staged", staged.StagedGemvConfig), ("packed", td.PackedGemvConfig)):
            best = min((t for t in alone if isinstance(t, cls)), key=alone.get)
            calls[name][kind_name] = layer_calls(x, ws, best, outs, space, **kw)
            entry[kind_name] = {"tile": td._config_name(best), "alone_us": round(alone[best], 2)}
            if name in ("gate_up", "down"):
                trace, us = traced(calls[name][kind_name], 20000 * LAYERS, dev)
                rows, ks = anatomy(trace)
                res["alone"][f"{name} {kind_name}"] = {"us_a_call": round(us, 2), **summary(rows, 1)}
                raw[f"alone {name} {kind_name}"] = ks
        res["products"][name] = entry
        print(name, json.dumps(entry), flush=True)
    names = [p[0] for p in QWEN2_VL_2B]
    mixes = {"packed": ("packed",) * 4, "staged": ("staged",) * 4,
             "fastest alone": tuple(min(("packed", "staged"), key=lambda kd: res["products"][nm][kd]["alone_us"])
                                    for nm in names)}
    for label, m in mixes.items():
        chain = [f for layer in zip(*[calls[nm][kd] for nm, kd in zip(names, m)]) for f in layer]
        trace, us = traced(chain, 20000 * LAYERS * 4, dev)
        rows, ks = anatomy(trace)
        res["chains"][label] = {"tiles": dict(zip(names, m)), "us_a_layer": round(us * 4, 2), **summary(rows, 4)}
        raw[f"chain {label}"] = ks
        print(label, json.dumps(res["chains"][label]), flush=True)
    allt = torch.cat([k[f] for ks in raw.values() for k in ks for f in ("start", "released", "end")]).unique().sort().values
    d = allt[1:] - allt[:-1]
    res["timer_min_step_ns"] = int(d[d > 0].min())
    res["loadavg_after"] = os.getloadavg()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "probe-chain-trace.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    torch.save(raw, os.path.join(out, "chain-trace-raw.pt"))


if __name__ == "__main__":
    main()
