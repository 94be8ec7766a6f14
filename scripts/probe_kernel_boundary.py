"""Diagnostic probe (not a benchmark): what a kernel boundary costs in a batch-1 decode step.

    python scripts/probe_kernel_boundary.py > OUT.json

A chain of 140 dependent phases (a 2B model's layers have 5 kernels each), each reading the
whole vector the phase before wrote, every program writing a slice of the next: as separate
kernels in stream order, as kernels launched as programmatic dependents (what the fused step
does), and as one persistent kernel whose programs wait on an arrival count per phase (what a
whole-step kernel would do). One CUDA graph each, µs per phase; with half and all the SMs as
programs. The persistent kernel's last vector is checked against the kernels'. Output of the run
the docs cite: docs/results/probes/h200-kernel-boundary.json."""
import json, sys, torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

W = 16  # outputs a program writes

@triton.jit
def phase_kernel(X, Y, n, PDL: tl.constexpr, W: tl.constexpr, VB: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.arange(0, VB)
    x = tl.load(X + r, mask=r < n, other=0.0)
    s = tl.sum(x, axis=0)
    o = pid * W + tl.arange(0, W)
    tl.store(Y + o, s * 1e-4 + o.to(tl.float32) * 1e-3, mask=o < n)

@triton.jit
def persistent_kernel(BUF, CNT, n, phases, P, W: tl.constexpr, VB: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, VB)
    for p in range(phases):
        if p > 0:
            c = tl.atomic_add(CNT + p - 1, 0, sem="acquire")
            while c < P:
                c = tl.atomic_add(CNT + p - 1, 0, sem="acquire")
        x = tl.load(BUF + p * n + r, mask=r < n, other=0.0, cache_modifier=".cg")
        s = tl.sum(x, axis=0)
        o = pid * W + tl.arange(0, W)
        tl.store(BUF + (p + 1) * n + o, s * 1e-4 + o.to(tl.float32) * 1e-3, mask=o < n)
        tl.debug_barrier()
        tl.atomic_add(CNT + p, 1, sem="release")

def graph_us(fn, phases, reps=50):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3 / phases

def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "cases": []}
    for progs in (sms // 2, sms):
        n = progs * W
        vb = triton.next_power_of_2(n)
        for phases in (140,):
            bufs = [torch.zeros(n, device="cuda") for _ in range(phases + 1)]
            for pdl in (False, True):
                def chain():
                    for i in range(phases):
                        phase_kernel[(progs,)](bufs[i], bufs[i + 1], n, PDL=pdl, W=W, VB=vb, num_warps=4,
                                               launch_pdl=pdl)
                us = graph_us(chain, phases)
                out["cases"].append({"kind": "kernels-pdl" if pdl else "kernels", "programs": progs, "us_per_phase": round(us, 3)})
            buf = torch.zeros((phases + 1) * n, device="cuda")
            cnt = torch.zeros(phases, dtype=torch.int32, device="cuda")
            def persistent():
                cnt.zero_()
                persistent_kernel[(progs,)](buf, cnt, n, phases, progs, W=W, VB=vb, num_warps=4)
            us = graph_us(persistent, phases)
            ok = torch.allclose(buf[phases * n:(phases + 1) * n], bufs[phases])
            out["cases"].append({"kind": "persistent", "programs": progs, "us_per_phase": round(us, 3), "matches_kernels": bool(ok)})
            print(json.dumps(out["cases"][-3:]), file=sys.stderr)
    print(json.dumps(out, indent=1))

main()
