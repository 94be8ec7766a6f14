"""Where a request's submit goes on a GPU: the bench's qwen2-vl-2b bf16 engine, 1024x768 picture, calls as
`bench gpu` makes them (64 tokens, then 1), each submit's parts timed by wrapping the functions it calls.
Usage: python probe_submit.py CACHE OUT.json LABEL"""
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from edgeinfer.bench.common import bench_checkpoint, bench_image, sync
from edgeinfer.bench.gpu import QUESTION, ours_config
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.engine import inputs as I

cache, out, label = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
parts: dict[str, float] = {}


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
    return wrapper


for name in ("image_key", "render_chat", "expand_images", "tokenize", "staged", "merge_embeddings"):
    setattr(I, name, timed(name, getattr(I, name)))
t0 = time.perf_counter()
DEV = os.environ.get("DEV", "cuda")
model = bench_checkpoint(os.environ.get("SHAPE", "qwen2-vl-2b"), cache)
t1 = time.perf_counter()
engine = Engine.load(model, config=ours_config("bfloat16", DEV, (1024, 768), 1))
t2 = time.perf_counter()
adapter = engine.inputs.adapter
adapter.process_image = timed("process_image", adapter.process_image)
engine.vision_cache.embeddings = timed("vision", engine.vision_cache.embeddings)
image = bench_image((1024, 768), seed=0)
calls = []
for i in range(int(os.environ.get("CALLS", 24))):
    for new in (int(os.environ.get("NEW", 64)), 1):
        engine.vision_cache.clear()
        sync(DEV)
        parts.clear()
        s = time.perf_counter()
        seq = engine.submit(QUESTION, [image], SamplingParams(max_new_tokens=new, ignore_eos=True))
        submitted = time.perf_counter() - s
        engine.run_until_done([seq])
        sync(DEV)
        calls.append({"new": new, "submit_ms": submitted * 1e3, **{k: v * 1e3 for k, v in parts.items()},
                      "call_ms": (time.perf_counter() - s) * 1e3})
pins = []
x = torch.empty(4200, 1176)
for i in range(20 if DEV.startswith("cuda") else 0):
    s = time.perf_counter()
    y = x.pin_memory()
    pins.append((time.perf_counter() - s) * 1e3)
    del y
prof = cProfile.Profile()
for i in range(6):
    engine.vision_cache.clear()
    sync(DEV)
    prof.enable()
    seq = engine.submit(QUESTION, [image], SamplingParams(max_new_tokens=1, ignore_eos=True))
    prof.disable()
    engine.run_until_done([seq])
    sync(DEV)
buf = io.StringIO()
pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
keys = sorted({k for c in calls for k in c if k != "new"})
summary = {k: [round(statistics.median(c.get(k, 0.0) for c in calls), 2), round(min(c.get(k, 0.0) for c in calls), 2),
               round(max(c.get(k, 0.0) for c in calls), 2)] for k in keys}
res = {"label": label, "load": os.getloadavg(), "threads": torch.get_num_threads(), "build_s": t1 - t0,
       "load_s": t2 - t1, "summary_median_min_max": summary, "calls": calls, "pin_memory_ms": pins,
       "profile": buf.getvalue()}
out.write_text(json.dumps(res, indent=1))
print(label, "threads", res["threads"], "build", round(t1 - t0, 1), "load", round(t2 - t1, 1))
for k, v in summary.items():
    print(f"  {k}: {v}")
print("  submit per call:", [round(c["submit_ms"], 1) for c in calls])
print("  pin_memory:", [round(p, 2) for p in pins])
print(buf.getvalue()[:3500])
