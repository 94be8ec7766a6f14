"""What runs beside a request in the seconds after Engine.load: the bench's qwen2-vl-2b engine (bf16 unless WEIGHTS),
then for WINDOW s the picture's processing and a pinned copy, back to back every 30 ms, each with every thread's CPU ticks,
the machine's CPU counters (steal included), the VM counters, our threads' time on a CPU and waiting for one
(schedstat) and involuntary switches, the machine's pressure (PSI) totals and every other process's CPU ticks; the same before load (processor only) and again after
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


def allowed():
    """Each thread's allowed CPUs, as {cpus: [tids]}."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            line = next(l for l in Path(f"/proc/self/task/{tid}/status").read_text().splitlines() if l.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            continue
        out.setdefault(line.split(":")[1].strip(), []).append(int(tid))
    return out


def sched():
    """Our threads' summed time on a CPU and time runnable but waiting for one (ns, /proc/.../schedstat), and
    their summed involuntary context switches."""
    run = wait = invol = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            a, b, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
            invol += int(next(l for l in Path(f"/proc/self/task/{tid}/status").read_text().splitlines()
                              if l.startswith("nonvoluntary_ctxt_switches")).split()[1])
        except (OSError, ValueError, StopIteration):
            continue
        run, wait = run + int(a), wait + int(b)
    return run, wait, invol


def pressure():
    """The machine's PSI totals (us): cpu some, memory some, io some; -1 where absent."""
    out = []
    for k in ("cpu", "memory", "io"):
        try:
            out.append(int(Path(f"/proc/pressure/{k}").read_text().split("total=")[1].split()[0]))
        except (OSError, IndexError, ValueError):
            out.append(-1)
    return out


def children():
    """CPU ticks of every other process on the machine with any, by pid/comm (all of them: a few hundred)."""
    me, out = str(os.getpid()), {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        out[f"{pid}/{stat[stat.index('(') + 1:stat.rindex(')')]}"] = int(f[11]) + int(f[12])
    return out


def machine():
    line = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vm = dict(l.split() for l in Path("/proc/vmstat").read_text().splitlines())
    return {"cpu": [int(x) for x in line], **{k: int(vm.get(k, -1)) for k in VM}}


def window(label, work, seconds, top_at=None):
    rows, prev_t, prev_m = [], threads(), machine()
    prev_s, prev_p, prev_o = sched(), pressure(), children()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        times = {}
        for name, fn in work.items():
            s = time.perf_counter()
            fn()
            times[name] = round((time.perf_counter() - s) * 1e3, 2)
        now_t, now_m = threads(), machine()
        now_s, now_p, now_o = sched(), pressure(), children()
        others = {k: d for k, v in now_o.items() if (d := v - prev_o.get(k, v)) > 0}
        busy = {f"{c}/{tid}": d for tid, (c, v, _) in now_t.items()
                if (d := v - prev_t.get(tid, (c, 0, 0))[1]) > 0}
        cpus = sorted({cpu for tid, (c, v, cpu) in now_t.items() if v - prev_t.get(tid, (c, 0, 0))[1] > 0})
        new = {tid: [c, Path(f"/proc/self/task/{tid}/wchan").read_text() if Path(f"/proc/self/task/{tid}/wchan").exists() else ""]
               for tid, (c, _, _) in now_t.items() if tid not in prev_t}
        rows.append({"t": round(time.perf_counter() - t0, 3), **times, "threads": len(now_t), "busy_ticks": busy,
                     "busy_cpus": cpus, "new_threads": new, "allowed": {k: len(v) for k, v in allowed().items()},
                     "cpu_delta": [a - b for a, b in zip(now_m["cpu"], prev_m["cpu"])],
                     "run_us": (now_s[0] - prev_s[0]) // 1000, "runq_wait_us": (now_s[1] - prev_s[1]) // 1000,
                     "involuntary": now_s[2] - prev_s[2], "psi_us": [a - b for a, b in zip(now_p, prev_p)],
                     "other_processes": others,
                     **{k: now_m[k] - prev_m[k] for k in VM if not k.startswith("nr_")},
                     **{k: now_m[k] for k in VM if k.startswith("nr_")}})
        prev_t, prev_m, prev_s, prev_p, prev_o = now_t, now_m, now_s, now_p, now_o
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
if float(os.environ.get("PAUSE", 10)) > 0:
    time.sleep(float(os.environ.get("PAUSE", 10)))
    res["windows"].append(window("10 s later", work, 2))
out.write_text(json.dumps(res))
for w in res["windows"]:
    rows = w["rows"]
    print(w["label"], len(rows), "iterations")
    for r in rows[:: max(1, len(rows) // 25)]:
        top = sorted(r["busy_ticks"].items(), key=lambda kv: -kv[1])[:5]
        print(f"  t={r['t']:6.2f} " + " ".join(f"{k}={r[k]}" for k in work if k in r) + f" {'processor=' + str(r['processor']) if 'processor' in r else ''}"
              f" thr={r['threads']} cpu(us,sy,id,st)={[r['cpu_delta'][i] for i in (0, 2, 3, 7)]} flt={r['pgfault']} mig={r['pgmigrate_success']} numa={r['numa_hint_faults']} run={r['run_us']} wait={r['runq_wait_us']} invol={r['involuntary']} psi={r['psi_us']} others={sorted(r['other_processes'].items(), key=lambda kv: -kv[1])[:3]} busy={top}")
print("load_s", round(res["load_s"], 1), "sync_after_load_ms", res.get("sync_after_load_ms"), res["env_malloc"], "threads", res["threads_after_load"])
print(res["windows"][1]["rows"][7].get("top", "")[:3500])
