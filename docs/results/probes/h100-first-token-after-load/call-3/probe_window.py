"""What runs beside a request in the seconds after Engine.load: the bench's qwen2-vl-2b engine (bf16 unless WEIGHTS),
then for WINDOW s the picture's processing and a pinned copy, back to back every 30 ms, each with every thread's CPU ticks,
the machine's CPU counters (steal included) and the VM counters; the same before load (processor only) and again after
a 10 s pause. THREADS: torch's threads after load; SYNC=1: time a device synchronize right after load. Usage: python probe_window.py CACHE OUT.json"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from edgeinfer.bench.common import bench_checkpoint, bench_image
from edgeinfer.bench.gpu import ours_config
from edgeinfer.engine import Engine

cache, out = Path(sys.argv[1]), Path(sys.argv[2])
WINDOW = float(os.environ.get("WINDOW", 8))
VM = ("pgfault", "pgmajfault", "thp_fault_alloc", "numa_hint_faults", "pgmigrate_success", "compact_stall",
      "pgfree", "pgalloc_normal", "pswpin", "nr_dirty", "nr_writeback")


def threads():
    res = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        res[tid] = (comm, int(f[11]) + int(f[12]), int(f[36]))  # utime+stime ticks, last CPU
    return res


def machine():
    line = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vm = dict(l.split() for l in Path("/proc/vmstat").read_text().splitlines())
    return {"cpu": [int(x) for x in line], **{k: int(vm.get(k, -1)) for k in VM}}


def window(label, work, seconds, top_at=None):
    rows, prev_t, prev_m = [], threads(), machine()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        times = {}
        for name, fn in work.items():
            s = time.perf_counter()
            fn()
            times[name] = round((time.perf_counter() - s) * 1e3, 2)
        now_t, now_m = threads(), machine()
        busy = {f"{c}/{tid}": d for tid, (c, v, _) in now_t.items()
                if (d := v - prev_t.get(tid, (c, 0, 0))[1]) > 0}
        rows.append({"t": round(time.perf_counter() - t0, 3), **times, "threads": len(now_t), "busy_ticks": busy,
                     "cpu_delta": [a - b for a, b in zip(now_m["cpu"], prev_m["cpu"])],
                     **{k: now_m[k] - prev_m[k] for k in VM if not k.startswith("nr_")},
                     **{k: now_m[k] for k in VM if k.startswith("nr_")}})
        prev_t, prev_m = now_t, now_m
        if top_at is not None and len(rows) == top_at:
            rows[-1]["top"] = subprocess.run(["top", "-H", "-bn1", "-w", "200"], capture_output=True, text=True).stdout[:6000]
        time.sleep(0.03)
    return {"label": label, "rows": rows}


model = bench_checkpoint(os.environ.get("SHAPE", "qwen2-vl-2b"), cache)
image = bench_image((1024, 768), seed=0)
buf = torch.empty(4200, 1176)
from transformers import AutoImageProcessor  # noqa: E402
proc = AutoImageProcessor.from_pretrained(model)
res = {"threads_torch": torch.get_num_threads(), "env": {k: v for k, v in os.environ.items() if "OMP" in k or "MKL" in k}}
res["windows"] = [window("before load", {"processor": lambda: proc(images=[image], return_tensors="pt"),
                                         "pin": lambda: buf.pin_memory() if torch.cuda.is_available() else None}, 2)]
s = time.perf_counter()
engine = Engine.load(model, config=ours_config(os.environ.get("WEIGHTS", "bfloat16"), "cuda" if torch.cuda.is_available() else "cpu", (1024, 768), 1))
res["load_s"] = time.perf_counter() - s
if os.environ.get("SYNC") and torch.cuda.is_available():
    s = time.perf_counter()
    torch.cuda.synchronize()
    res["sync_after_load_ms"] = (time.perf_counter() - s) * 1e3
if os.environ.get("THREADS"):
    torch.set_num_threads(int(os.environ["THREADS"]))
res["threads_after_load"] = torch.get_num_threads()
res["env_malloc"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
adapter = engine.inputs.adapter
work = {"process_image": lambda: adapter.process_image(image),
        "pin": lambda: buf.pin_memory() if torch.cuda.is_available() else None}
res["windows"].append(window("after load", work, WINDOW, top_at=8))
time.sleep(10)
res["windows"].append(window("10 s later", work, 2))
out.write_text(json.dumps(res))
for w in res["windows"]:
    rows = w["rows"]
    print(w["label"], len(rows), "iterations")
    for r in rows[:: max(1, len(rows) // 25)]:
        top = sorted(r["busy_ticks"].items(), key=lambda kv: -kv[1])[:5]
        print(f"  t={r['t']:6.2f} " + " ".join(f"{k}={r[k]}" for k in work if k in r) + f" {'processor=' + str(r['processor']) if 'processor' in r else ''}"
              f" thr={r['threads']} cpu(us,sy,id,st)={[r['cpu_delta'][i] for i in (0, 2, 3, 7)]} flt={r['pgfault']} mig={r['pgmigrate_success']} numa={r['numa_hint_faults']} busy={top}")
print("load_s", round(res["load_s"], 1), "sync_after_load_ms", res.get("sync_after_load_ms"), res["env_malloc"], "threads", res["threads_after_load"])
print(res["windows"][1]["rows"][7].get("top", "")[:3500])
