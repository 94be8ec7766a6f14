"""Time the batch-1 decode step's layers (the fused kernels, Qwen2-VL-2B's shapes, 28 layers) with
the kernels launched as programmatic dependents and without, in one process, from CUDA graphs.

Random weights in bf16, 4-bit and 8-bit (groups of 128), a past of 1,019 positions; the tiles are
the ones the H200 benchmark of 2026-12-03 chose for each product
(``docs/results/gpu-qwen2-vl-2b-bf16-w4a16-h8-w8a16-batched-dot.json``). The two modes alternate,
each timed from its own graph; medians of every replay. A diagnostic, not a benchmark: the head
and the sampler are left out. Its H200 runs are ``docs/results/h200-probe-layers-*.json``.

``--parts`` also times each kernel alone, 28 of it in a graph (one a layer, each on its own
weights), in both modes, and gives each product's bytes a second; ``--sweep`` times more tiles
for each product (and attention's context chunks) that way, launched as dependents.

    python scripts/probe_dependent_launch.py --out probe.json --parts --sweep
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace

import torch

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.backends.torch.decode_attention import TILING, AttentionTiling, paged_attention
from edgeinfer.quant import launching
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
        self.tiles = dict(TILES[fmt])
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
        self.workspace = launching.SplitWorkspace(torch.device("cuda"))
        self.inputs = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                       for name, (_, k) in SHAPES.items()}
        self.qkv = torch.randn(1, SHAPES["qkv"][0], device="cuda", dtype=torch.bfloat16)

    def product(self, name: str, x: torch.Tensor, w, tile=None, **kw) -> torch.Tensor:
        tile = tile or self.tiles[name]
        if isinstance(w, PackedMatrix):
            return td.packed_gemv(x, w, tile, workspace=self.workspace, **kw)
        return td.gemv(x, w, config=tile, **kw)

    def __call__(self) -> torch.Tensor:
        x = self.x
        for i, w in enumerate(self.weights):
            qkv = self.product("qkv", x, w["qkv"], norm_weight=self.norm, eps=1e-6)
            attn = paged_attention(qkv, self.cos, self.sin, self.k_pool[i], self.v_pool[i], self.tables, self.lens,
                                   heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                   new_kv=(self.new_k[i], self.new_v[i]), workspace=self.workspace)
            x = self.product("o", attn, w["o"], residual=x)
            act = self.product("gate_up", x, w["gate_up"], norm_weight=self.norm, eps=1e-6, glu=True)
            x = self.product("down", act, w["down"], residual=x)
        return x

    def attention(self, i: int, tiling: AttentionTiling = TILING) -> torch.Tensor:
        return paged_attention(self.qkv, self.cos, self.sin, self.k_pool[i], self.v_pool[i], self.tables,
                               self.lens, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               new_kv=(self.new_k[i], self.new_v[i]), workspace=self.workspace, tiling=tiling)

    def part(self, name: str, tile=None):
        """One kernel (``name``: a product, or ``attention``, ``tile`` then its tiling) once a layer."""
        if name == "attention":
            return lambda: [self.attention(i, tile or TILING) for i in range(LAYERS)][-1]
        kw = {"qkv": {"norm_weight": self.norm, "eps": 1e-6}, "o": {"residual": self.x}, "down": {"residual": self.x},
              "gate_up": {"norm_weight": self.norm, "eps": 1e-6, "glu": True}}[name]
        x = self.inputs[name]
        return lambda: [self.product(name, x, w[name], tile, **kw) for w in self.weights][-1]


SWEEP_TILES = {  # tiles beyond the benchmark's choice: whole rows of K = 1,536 in one step, more splits of down,
    # 16-row tiles held to 96 registers a thread (``/r96``)
    "w4": {
        "qkv": [(8, 2048, 4), (4, 2048, 2), (16, 1024, 4), (8, 512, 2)],
        "o": [(8, 2048, 4), (4, 2048, 2), (16, 1024, 4), (8, 512, 2)],
        "gate_up": [(16, 512, 2, 1, 96), (8, 512, 2), (16, 512, 4), (32, 512, 4), (16, 2048, 4), (8, 2048, 4)],
        "down": [(8, 1024, 4, 8), (16, 1024, 4, 8), (16, 1024, 4, 8, 96), (8, 2048, 4, 4), (8, 512, 4, 4)]},
}
SWEEP_TILES["w8"] = SWEEP_TILES["w4"]


def sweep_tiles(fmt: str) -> dict[str, list]:
    return {name: [td.PackedGemvConfig(*t) for t in tiles] for name, tiles in SWEEP_TILES.get(fmt, {}).items()}
ATTENTION_CHUNKS = (32, 64, 128, 256)


def per_call_us(fn, replays: int, calls: int = LAYERS) -> float:
    times, _ = replay_us(fn, replays)
    return statistics.median(times) / calls


def parts(layers: Layers, replays: int) -> dict:
    out = {}
    for name in (*SHAPES, "attention"):
        row = {}
        for mode, env in (("plain", "0"), ("dependent", "1")):
            os.environ[launching.DEPENDENT_LAUNCH_ENV] = env
            row[f"{mode}_us"] = round(per_call_us(layers.part(name), replays), 2)
        if name != "attention":
            nbytes = td._nbytes(layers.weights[0][name])
            row["bytes"] = nbytes
            row["dependent_GBps"] = round(nbytes / row["dependent_us"] / 1e3, 1)
        out[name] = row
    return out


def sweep(layers: Layers, replays: int) -> dict:
    os.environ[launching.DEPENDENT_LAUNCH_ENV] = "1"
    out = {}
    for name, tiles in sweep_tiles(layers.fmt).items():
        row = {}
        for tile in (TILES[layers.fmt][name], *tiles):
            try:
                row[td._config_name(tile)] = round(per_call_us(layers.part(name, tile), replays), 2)
            except Exception as e:  # a tile the device cannot run is a finding, not a stop
                row[td._config_name(tile)] = f"{type(e).__name__}: {str(e)[:200]}"
        out[name] = row
    return out


def attention_chunks(layers: Layers, replays: int) -> dict:
    os.environ[launching.DEPENDENT_LAUNCH_ENV] = "1"
    out = {}
    for chunk in ATTENTION_CHUNKS:
        out[str(chunk)] = round(per_call_us(layers.part("attention", replace(TILING, chunk=chunk)), replays), 2)
    return out


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
    parser.add_argument("--parts", action="store_true", help="each kernel alone, both modes")
    parser.add_argument("--sweep", action="store_true", help="more tiles for each product, attention's chunks")
    args = parser.parse_args()
    import triton

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "load_average": os.getloadavg(), "layers": LAYERS, "context": CONTEXT, "tiles": {
                  fmt: {name: td._config_name(t) for name, t in tiles.items()} for fmt, tiles in TILES.items()},
              "formats": {}}
    def save() -> None:
        report["load_average_after"] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    for fmt in args.formats.split(","):
        layers = Layers(fmt)
        runs: dict[str, list[float]] = {"plain": [], "dependent": []}
        outs = {}
        for _ in range(args.rounds):
            for mode, env in (("plain", "0"), ("dependent", "1")):
                os.environ[launching.DEPENDENT_LAUNCH_ENV] = env
                times, outs[mode] = replay_us(layers, args.replays)
                runs[mode].extend(times)
        plain, dependent = statistics.median(runs["plain"]), statistics.median(runs["dependent"])
        report["formats"][fmt] = row = {
            "plain_us": round(plain, 1), "dependent_us": round(dependent, 1),
            "plain_over_dependent": round(plain / dependent, 3), "same_output": bool(torch.equal(outs["plain"],
                                                                                                 outs["dependent"])),
            "replays_us": {mode: [round(t, 1) for t in times] for mode, times in runs.items()}}
        print(fmt, {k: v for k, v in row.items() if k != "replays_us"}, flush=True)
        save()
        if args.parts:
            row["parts"] = parts(layers, args.replays)
            print(fmt, "parts", row["parts"], flush=True)
            save()
        if args.sweep and sweep_tiles(fmt):  # bf16 has no tiles to sweep
            row["sweep"] = sweep(layers, args.replays)
            print(fmt, "sweep", row["sweep"], flush=True)
            best = {name: min(times, key=lambda t: times[t] if isinstance(times[t], float) else 1e9)
                    for name, times in row["sweep"].items()}
            tiles = {name: t for name in best for t in (TILES[fmt][name], *sweep_tiles(fmt)[name])
                     if td._config_name(t) == best[name]}
            layers.tiles = tiles
            os.environ[launching.DEPENDENT_LAUNCH_ENV] = "1"
            row["best_tiles"] = best
            row["best_tiles_dependent_us"] = round(statistics.median(replay_us(layers, args.replays)[0]), 1)
            print(fmt, "best tiles", best, row["best_tiles_dependent_us"], flush=True)
            if "attention_chunks" not in report:
                report["attention_chunks"] = attention_chunks(layers, args.replays)
                print("attention chunks", report["attention_chunks"], flush=True)
            save()
        del layers
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
