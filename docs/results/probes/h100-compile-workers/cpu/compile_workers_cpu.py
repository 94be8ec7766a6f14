"""On a machine without a GPU, with Triton importable: what torch.compile's compile workers are, as
edgeinfer.backends.torch.compile_workers starts and stops them. Prints, as JSON: the process's threads
before the start, once started and once the workers are up (with the seconds that took), the workers'
processes (command, CPU seconds) and their summed PSS, how long release() took, and the processes left
after it.  python compile_workers_cpu.py"""
import json
import os
import threading
import time
from pathlib import Path

from torch._inductor import async_compile

from edgeinfer.backends.torch import compile_workers


def threads():
    return sorted(t.name for t in threading.enumerate())


def family():
    """Our descendant processes: [pid, command, CPU seconds, PSS KiB]."""
    parent = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            parent[p.name] = stat[stat.rindex(")") + 2:].split()
    ours, frontier = [], [str(os.getpid())]
    while frontier:
        frontier = [p for p, f in parent.items() if f[1] in frontier]
        ours += frontier
    out = []
    for p in ours:
        try:
            cmd = (Path("/proc") / p / "cmdline").read_bytes().split(b"\0")
            pss = int(next(line for line in (Path("/proc") / p / "smaps_rollup").read_text().splitlines()
                           if line.startswith("Pss:")).split()[1])
        except (OSError, StopIteration):
            continue
        f = parent[p]
        command = " ".join([os.path.basename(cmd[0].decode())] + [c.decode().split("site-packages/")[-1] for c in cmd[1:2]])
        out.append([int(p), command, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"), pss])
    return out


res = {"cores": os.cpu_count(), "load_before": Path("/proc/loadavg").read_text().split()[:3],
       "compile_threads": async_compile.get_compile_threads(), "threads_before": threads()}
t0 = time.perf_counter()
compile_workers.start("cuda")
res["threads_once_started"] = threads()
while not async_compile.AsyncCompile._ready_future.done():
    time.sleep(0.01)
res["up_after_s"] = round(time.perf_counter() - t0, 2)
res["threads_once_up"] = threads()
time.sleep(1)
res["processes_once_up"] = family()
res["pss_mib_once_up"] = round(sum(p[3] for p in res["processes_once_up"]) / 1024, 1)
t0 = time.perf_counter()
res["released"] = compile_workers.release("cuda")
res["release_s"] = round(time.perf_counter() - t0, 2)
res["processes_after_release"] = family()
print(json.dumps(res))
