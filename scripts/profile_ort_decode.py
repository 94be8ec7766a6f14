#!/usr/bin/env python3
"""Where an ONNX Runtime decode step's time goes on a CPU: built decoder graphs taken in turn.

    python scripts/profile_ort_decode.py --graph int8=ENGINES/m/cpu/decoder.onnx \
        --graph int4=ENGINES2/m/cpu/decoder.onnx --rounds 5 --out profile.json

For each round and each graph (in turn, each in its own session): the wall time of unprofiled
decode steps (one token, a past of ``--context`` positions in a pool of ``--blocks`` blocks, the
sequence's block table as the engine passes it: its own blocks only), then
the same steps under ORT's profiler, summed by operator type per step. The weight products are
``DynamicQuantizeMatMul`` / ``MatMulInteger`` (int8) and ``MatMulNBits`` (int4). The load average is
recorded around every round; nothing here is a pass/fail check. ``--no-spin`` runs the sessions
as the engine runs its decoder, with ORT's worker threads sleeping as soon as they run out of work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from edgeinfer.bench.common import cpu_identity

PRODUCTS = ("DynamicQuantizeMatMul", "MatMulInteger", "MatMulNBits")


def feeds_for(session, context: int, blocks: int, block_size: int) -> dict[str, np.ndarray]:
    """Random inputs of one decode step for the graph's own input shapes."""
    shapes = {i.name: i.shape for i in session.get_inputs()}
    layers, _, _, kv_heads, head_dim = shapes["k_pool"]
    hidden = shapes["inputs_embeds"][-1]
    rng = np.random.default_rng(0)
    pool = (layers, blocks, block_size, kv_heads, head_dim)
    return {"inputs_embeds": rng.standard_normal((1, 1, hidden), dtype=np.float32),
            "position_ids": np.array([[context]], dtype=np.int64),
            "k_pool": rng.standard_normal(pool, dtype=np.float32) * 0.1,
            "v_pool": rng.standard_normal(pool, dtype=np.float32) * 0.1,
            # the sequence's own blocks, as the engine passes them (runner.block_tables): its past and this token
            "block_tables": np.arange(-(-(context + 1) // block_size), dtype=np.int64)[None, :],
            "context_lens": np.array([context], dtype=np.int64)}


def profile_graph(path: str, args, scratch: str) -> dict:
    import onnxruntime as ort

    def session(profile: bool):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = args.threads
        if args.no_spin:  # as the engine runs its decoder (backends/onnx/runtime.py: open_engines)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if profile:
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(scratch, "ort")
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    plain = session(False)
    feeds = feeds_for(plain, args.context, args.blocks, args.block_size)
    for _ in range(args.warmup):
        plain.run(None, feeds)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        plain.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    profiled = session(True)
    for _ in range(args.warmup + args.steps):
        profiled.run(None, feeds)
    events = json.loads(Path(profiled.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[args.warmup:]
    by_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and any(a <= e["ts"] <= b for a, b in runs):
            by_op[e["args"]["op_name"]] += e["dur"]
    n = len(runs)
    ms = {op: round(us / n / 1e3, 3) for op, us in by_op.most_common()}
    return {"step_ms": [round(t, 2) for t in times], "step_ms_median": round(statistics.median(times), 2),
            "profiled_ms_by_op": ms, "profiled_node_ms": round(sum(ms.values()), 2),
            "weight_products_ms": round(sum(v for op, v in ms.items() if op in PRODUCTS), 2)}


def summary(rounds: list[dict], graphs) -> dict[str, dict[str, float]]:
    """Per graph: the median of every unprofiled step of every round, and the medians over the
    rounds of the profiled figures (one a round)."""
    return {name: {"step_ms_median": round(statistics.median(t for r in rounds for t in r["graphs"][name]["step_ms"]), 2),
                   **{key: round(statistics.median(r["graphs"][name][key] for r in rounds), 2)
                      for key in ("weight_products_ms", "profiled_node_ms")}}
            for name in graphs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="append", required=True, metavar="NAME=PATH", help="a built decoder.onnx")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-spin", action="store_true", help="ORT's threads sleep between operators, as the engine's do")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    graphs = dict(g.split("=", 1) for g in args.graph)
    report = {"args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              **cpu_identity(), "cores": os.cpu_count(), "load_before": os.getloadavg(), "rounds": []}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.rounds):
            report["rounds"].append({"load": os.getloadavg(),
                                     "graphs": {name: profile_graph(path, args, scratch) for name, path in graphs.items()}})
    report["load_after"] = os.getloadavg()
    report["summary"] = summary(report["rounds"], graphs)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"]))


if __name__ == "__main__":
    main()
