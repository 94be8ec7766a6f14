"""Diagnostic probe (not a benchmark): what a kernel boundary costs in a batch-1 decode step.

    python scripts/probe_kernel_boundary.py > OUT.json

A chain of 140 dependent phases (a 2B model's layers have 5 kernels each), each reading the
whole vector the phase before wrote, every program writing a slice of the next: as separate
kernels in stream order, as kernels launched as programmatic dependents (what the fused step
does), and as one persistent kernel whose programs wait on an arrival count per phase (what a
whole-step kernel would do). One CUDA graph each, µs per phase; with half and all the SMs as
programs. The persistent kernel's last vector is checked against the kernels'. Output of the run
the docs cite: docs/results/probes/h200-kernel-boundary.json."""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from edgeinfer.quant.kernels import graph_time_us

W = 16  # outputs a program writes
PHASES = 140


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
        if p > 0:  # every program of the phase before has written its slice
            c = tl.atomic_add(CNT + p - 1, 0, sem="acquire")
            while c < P:
                c = tl.atomic_add(CNT + p - 1, 0, sem="acquire")
        x = tl.load(BUF + p * n + r, mask=r < n, other=0.0, cache_modifier=".cg")
        s = tl.sum(x, axis=0)
        o = pid * W + tl.arange(0, W)
        tl.store(BUF + (p + 1) * n + o, s * 1e-4 + o.to(tl.float32) * 1e-3, mask=o < n)
        tl.debug_barrier()
        tl.atomic_add(CNT + p, 1, sem="release")


def phase_us(fn) -> float:
    """Device µs per phase of ``fn`` (all PHASES of them), replayed from one CUDA graph."""
    return graph_time_us([fn], repeats=50) / PHASES


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "cases": []}
    for progs in (sms // 2, sms):
        n = progs * W
        vb = triton.next_power_of_2(n)
        bufs = [torch.zeros(n, device="cuda") for _ in range(PHASES + 1)]
        for pdl in (False, True):
            def chain(pdl=pdl):
                for i in range(PHASES):
                    phase_kernel[(progs,)](bufs[i], bufs[i + 1], n, PDL=pdl, W=W, VB=vb, num_warps=4, launch_pdl=pdl)
            out["cases"].append({"kind": "kernels-pdl" if pdl else "kernels", "programs": progs,
                                 "us_per_phase": round(phase_us(chain), 3)})
        buf = torch.zeros((PHASES + 1) * n, device="cuda")
        cnt = torch.zeros(PHASES, dtype=torch.int32, device="cuda")

        def persistent():
            cnt.zero_()
            persistent_kernel[(progs,)](buf, cnt, n, PHASES, progs, W=W, VB=vb, num_warps=4)
        us = phase_us(persistent)
        same = torch.allclose(buf[PHASES * n:], bufs[PHASES])
        out["cases"].append({"kind": "persistent", "programs": progs, "us_per_phase": round(us, 3),
                             "matches_kernels": bool(same)})
        print(json.dumps(out["cases"][-3:]), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
