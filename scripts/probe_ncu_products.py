"""Diagnostic probe (not a benchmark): a batch-1 decode step's products, each launched once inside
a profiler range, for Nsight Compute to read the hardware counters of.

    ncu --clock-control none --profile-from-start off --set full -o OUT/products \\
        python scripts/probe_ncu_products.py

Each product of a Qwen2-VL-2B layer with the prologue and epilogue the fused decode step gives it
(q|k|v: RMSNorm and bias; o: residual; gate|up: RMSNorm and SiLU·up; down: residual), 4-bit g128
symmetric bf16 scales, at the tiles the H200's tuner chose in run K (the raw file's
``diagnostics.kernels.products``), the int8 ``lm_head``, and beside them the bf16 GEMV of gate|up
and down at their chosen tiles the tensor-core kernel on gate|up's one row, and gate|up's and down's tiles again with the register
caps tried on the H200 and not kept (``ONLY=/r`` selects those;
docs/results/probes/h200-register-caps-same-call), and the staged kernel's tiles that were the fastest
alone on an H100 with gate|up's unsplit one-warp tile (``ONLY=staged``; docs/results/probes/h100-fused-mlp and
h100-ncu-staged). Each is launched
twice before the range (its compile and first use), then once inside it, in the order of
``KERNELS``, which the report's rows follow. Nsight Compute empties the caches before each of its
replays, so every weight comes from memory as in a step.
"""
import os

import torch

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels, staged
from edgeinfer.testing.products import fused_inputs, random_packed

dev, bf = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)


def packed_call(n, k, bits, gs, kind, config):
    """A packed product as the decode step dispatches its tile (``td.one_row_product``: a staged tile on the staged kernel)."""
    w, (x, kw) = random_packed(n, k, bits, gs, dev), fused_inputs(kind, n, k, dev)
    workspace = td.SplitWorkspace(dev)
    return lambda: td.one_row_product(x, w, config, workspace=workspace, **kw)


def dense_call(n, k, kind, config):
    w, (x, kw) = torch.randn(n, k, device=dev, dtype=bf), fused_inputs(kind, n, k, dev)
    return lambda: td.gemv(x, w, config=config, **kw)


def tensor_core_call(n, k, config):
    w, x = random_packed(n, k, 4, 128, dev), torch.randn(1, k, device=dev, dtype=bf)
    return lambda: kernels.packed_mm(x, w.codes, w.scales, None, w.layout, config)


KERNELS = {  # name: the call, at run K's tiles
    "w4 qkv 16x2048/4w": packed_call(2048, 1536, 4, 128, "norm+bias", td.PackedGemvConfig(16, 2048, 4)),
    "w4 o 8x2048/4w": packed_call(1536, 1536, 4, 128, "residual", td.PackedGemvConfig(8, 2048, 4)),
    "w4 gate_up 32x256/4w": packed_call(17920, 1536, 4, 128, "norm+glu", td.PackedGemvConfig(32, 256, 4)),
    "w4 gate_up 16x512/2w": packed_call(17920, 1536, 4, 128, "norm+glu", td.PackedGemvConfig(16, 512, 2)),
    "w4 down 16x1024/4w/s8": packed_call(1536, 8960, 4, 128, "residual", td.PackedGemvConfig(16, 1024, 4, 8)),
    # the same tiles with a register cap: the next step's words asked for at the top of the step
    "w4 gate_up 32x256/4w/r128": packed_call(17920, 1536, 4, 128, "norm+glu", td.PackedGemvConfig(32, 256, 4, 1, 128)),
    "w4 gate_up 16x512/2w/r168": packed_call(17920, 1536, 4, 128, "norm+glu", td.PackedGemvConfig(16, 512, 2, 1, 168)),
    "w4 down 16x1024/4w/s8/r168": packed_call(1536, 8960, 4, 128, "residual", td.PackedGemvConfig(16, 1024, 4, 8, 168)),
    "w8 lm_head 32x256/4w": packed_call(151936, 1536, 8, 1536, "norm", td.PackedGemvConfig(32, 256, 4)),
    "bf16 gate_up 8x128/2w/4s": dense_call(17920, 1536, "norm+glu", td.GemvConfig(8, 128, 2, 4)),
    "bf16 down 4x1024/8w/2s": dense_call(1536, 8960, "residual", td.GemvConfig(4, 1024, 8, 2)),
    "w4 gate_up tensor core 128x64/s1": tensor_core_call(17920, 1536, kernels.MmConfig(128, 64, 1, stages=2, mma=True)),
    # the staged tiles fastest alone on an H100 (probes/h100-fused-mlp), and gate|up's unsplit one-warp tile
    "w4 gate_up staged/4w/split3": packed_call(17920, 1536, 4, 128, "norm+glu", staged.StagedGemvConfig(4, 3)),
    "w4 gate_up staged/1w/split1": packed_call(17920, 1536, 4, 128, "norm+glu", staged.StagedGemvConfig(1, 1)),
    "w4 down staged/1w/split10": packed_call(1536, 8960, 4, 128, "residual", staged.StagedGemvConfig(1, 10)),
    "w4 down staged/4w/split10": packed_call(1536, 8960, 4, 128, "residual", staged.StagedGemvConfig(4, 10)),
}

if __name__ == "__main__":
    names = [n for n in KERNELS if os.environ.get("ONLY", "") in n]
    for name in names:
        KERNELS[name]()
        KERNELS[name]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name in names:
        KERNELS[name]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("\n".join(f"{i}: {n}" for i, n in enumerate(names)))
