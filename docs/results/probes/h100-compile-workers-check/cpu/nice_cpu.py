"""On a machine without a GPU, with Triton importable: a picture-sized parallel torch section (bicubic resize of a
3x1536x2048 float picture to 768x1024, antialiased, on torch's threads: one a core) back to back for WINDOW s, while
torch.compile's compile workers start as edgeinfer.backends.torch.compile_workers.start starts them (MODE=start), or
with none starting (MODE=none). Which compile_workers.py runs is PYTHONPATH's. Prints one JSON line: each iteration's
ms with its time, when the workers were up, the first process's nice, the load average before.  python nice_cpu.py"""
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from edgeinfer.backends.torch import compile_workers

WINDOW, MODE = float(os.environ.get("WINDOW", 6)), os.environ.get("MODE", "start")
res = {"mode": MODE, "threads": torch.get_num_threads(), "load_before": Path("/proc/loadavg").read_text().split()[:3],
       "module": compile_workers.__file__.split("edgeinfer/")[-1], "tree": Path(compile_workers.__file__).parents[3].name}
x = torch.rand(1, 3, 1536, 2048)
for _ in range(3):
    F.interpolate(x, size=(768, 1024), mode="bicubic", antialias=True)
from torch._inductor import async_compile  # noqa: E402

t0 = time.perf_counter()
if MODE == "start":
    compile_workers.start("cuda")
    pool = async_compile.AsyncCompile.process_pool()
    res["nice"] = os.getpriority(os.PRIO_PROCESS, pool.process.pid)
res["start_s"] = round(time.perf_counter() - t0, 3)
rows, up = [], None
while (t := time.perf_counter() - t0) < WINDOW:
    s = time.perf_counter()
    F.interpolate(x, size=(768, 1024), mode="bicubic", antialias=True)
    rows.append([round(t, 3), round((time.perf_counter() - s) * 1e3, 2)])
    ready = async_compile.AsyncCompile._ready_future
    if up is None and ready is not None and ready.done():
        up = round(time.perf_counter() - t0, 3)
if MODE == "start" and up is None:
    async_compile.AsyncCompile._ready_future.result(timeout=120)
    res["up_after_window_s"] = round(time.perf_counter() - t0, 3)
res["up_s"], res["rows"] = up, rows
t1 = time.perf_counter()
res["released"] = compile_workers.release("cuda")
res["release_s"] = round(time.perf_counter() - t1, 3)
print(json.dumps(res))
