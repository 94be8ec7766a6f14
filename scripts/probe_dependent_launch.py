"""Time the batch-1 decode step's layers (the fused kernels, Qwen2-VL-2B's shapes, 28 layers) with
the kernels launched as programmatic dependents and without, in one process, from CUDA graphs.

Random weights in bf16, 4-bit and 8-bit (groups of 128), a past of 1,019 positions; the tiles are
the ones the H200 benchmark of 2026-12-03 chose for each product
(``docs/results/gpu-qwen2-vl-2b-bf16-w4a16-h8-w8a16-batched-dot.json``). The two modes alternate,
each timed from its own graph; medians of every replay. A diagnostic, not a benchmark: the head
and the sampler are left out. Not yet run on a GPU.

    python scripts/probe_dependent_launch.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant import kernels
from edgeinfer.quant.packed import PackedMatrix

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, CONTEXT, BLOCK = 1536, 8960, 12, 2, 128, 28, 1019, 16
SHAPES = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
          "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
TILES = {
    "bf16": {"qkv": td.GemvConfig(2, 512, 2, 3), "o": td.GemvConfig(2, 1024, 4, 2),
             "gate_up": td.GemvConfig(8, 512, 4, 2), "down": td.GemvConfig(8, 1024, 8, 2)},
    "w4": {"qkv": td.PackedGemvConfig(8, 1024, 4), "o": td.PackedGemvConfig(8, 1024, 4),
           "gate_up": td.PackedGemvConfig(16, 512, 2), "down": td.PackedGemvConfig(8, 1024, 4, 4)},
    "w8": {"qkv": td.PackedGemvConfig(8, 1024, 4), "o": td.PackedGemvConfig(8, 1024, 4),
           "gate_up": td.PackedGemvConfig(16, 512, 4), "down": td.PackedGemvConfig(8, 512, 4, 4)},
}


def weight(fmt: str, n: int, k: int) -> torch.Tensor | PackedMatrix:
    if fmt == "bf16":
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bits = 4 if fmt == "w4" else 8
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // 128, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
    return PackedMatrix(codes, scales, None, bits, 128, (n, k))


class Layers:
    """The step's layers on random weights of one format."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.weights = [{name: weight(fmt, *shape) for name, shape in SHAPES.items()} for _ in range(LAYERS)]
        blocks = -(-(CONTEXT + 1) // BLOCK)
        self.k_pool = torch.randn(LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.v_pool = torch.randn_like(self.k_pool)
        self.tables = torch.arange(blocks, device="cuda").view(1, blocks)
        self.lens = torch.tensor([CONTEXT], device="cuda")
        self.new_k = torch.empty(LAYERS, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.new_v = torch.empty_like(self.new_k)
        angle = torch.rand(1, HEAD_DIM // 2, device="cuda") * 6
        self.cos = torch.cat((angle.cos(), angle.cos()), -1).to(torch.bfloat16)
        self.sin = torch.cat((angle.sin(), angle.sin()), -1).to(torch.bfloat16)
        self.norm = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5
        self.x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.workspace = kernels.SplitWorkspace(torch.device("cuda"))

    def product(self, name: str, x: torch.Tensor, w, **kw) -> torch.Tensor:
        tile = TILES[self.fmt][name]
        if isinstance(w, PackedMatrix):
            return td.packed_gemv(x, w, tile, workspace=self.workspace, **kw)
        return td.gemv(x, w, config=tile, **kw)

    def __call__(self) -> torch.Tensor:
        x = self.x
        for i, w in enumerate(self.weights):
            qkv = self.product("qkv", x, w["qkv"], norm_weight=self.norm, eps=1e-6)
            attn = td.paged_attention(qkv, self.cos, self.sin, self.k_pool[i], self.v_pool[i], self.tables, self.lens,
                                      heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      new_kv=(self.new_k[i], self.new_v[i]))
            x = self.product("o", attn, w["o"], residual=x)
            gate_up = self.product("gate_up", x, w["gate_up"], norm_weight=self.norm, eps=1e-6)
            x = self.product("down", gate_up, w["down"], residual=x, silu_mul=True)
        return x


def replay_us(fn, replays: int) -> tuple[list[float], torch.Tensor]:
    """Microseconds of each replay of a graph of ``fn``, and its output."""
    fn()  # compiled, and the split workspace sized, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times, out.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--formats", default="w4,bf16,w8")
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs, each its own graph")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    import triton

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "load_average": os.getloadavg(), "layers": LAYERS, "context": CONTEXT, "tiles": {
                  fmt: {name: td._config_name(t) for name, t in tiles.items()} for fmt, tiles in TILES.items()},
              "formats": {}}
    for fmt in args.formats.split(","):
        layers = Layers(fmt)
        runs: dict[str, list[float]] = {"plain": [], "dependent": []}
        outs = {}
        for _ in range(args.rounds):
            for mode, env in (("plain", "0"), ("dependent", "1")):
                os.environ[kernels.DEPENDENT_LAUNCH_ENV] = env
                times, outs[mode] = replay_us(layers, args.replays)
                runs[mode].extend(times)
        plain, dependent = statistics.median(runs["plain"]), statistics.median(runs["dependent"])
        report["formats"][fmt] = {
            "plain_us": round(plain, 1), "dependent_us": round(dependent, 1),
            "plain_over_dependent": round(plain / dependent, 3), "same_output": bool(torch.equal(outs["plain"],
                                                                                                 outs["dependent"])),
            "replays_us": {mode: [round(t, 1) for t in times] for mode, times in runs.items()}}
        print(fmt, {k: v for k, v in report["formats"][fmt].items() if k != "replays_us"}, flush=True)
        del layers
        torch.cuda.empty_cache()
        report["load_average_after"] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
