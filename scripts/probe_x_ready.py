"""Diagnostic probe (not a benchmark): what x's work costs the batch-1 integer-dot products in time, on a GPU,
before anything is built to save it.

    OUT=folder OUTER=3 ROUNDS=3 python scripts/probe_x_ready.py --all    # the three ways in turns
    WAY=ready ROUNDS=3 python scripts/probe_x_ready.py                    # one way, one process

An integer-dot K step (``triton_decode._integer_dot``) reads each of its words' columns of x, RMSNorms them where
the product has a norm, and rounds them to 16-bit integers at the word's scale; every program of the product does
this for every column it reads. Three ways (``WAYS``), each in a process of its own, since Triton memoizes a
kernel's compile key a process:

- ``built``: the kernel as it is;
- ``hoisted``: x's values the same at every step (``_input_values`` reads no column), so that the compiler takes
  x's loads, norm and rounding out of the loop: a floor. Its outputs are wrong;
- ``ready``: x's integer form read ready-made each step, as a product could read it if the kernel before wrote it:
  six 4-byte loads a word of x (four pairs of 16-bit integers, the word's scale and the sum of its integers) in
  place of its eight columns of x (and eight of the norm's weight), normed, scaled and rounded. The loads read the
  norm weight's bytes (a buffer four times its size, where the product has a norm) or the codes' (where it has not),
  so its outputs are wrong too: it sizes the change, it does not build it.

Each of a Qwen2-VL-2B layer's four 4-bit products (random codes, groups of 128) fused as the step fuses it, over
28 copies of its weight, on the integer-dot tile an H100's step keeps for it (``TILES``), timed ``ROUNDS`` times
(28 calls from one CUDA graph, as the tuner times a tile); then the four in the step's order over 28 layers. µs a
call, µs a layer for the chain. The ``built`` way also times ``down`` at 8,192 and 9,216 columns beside its own
8,960 (``DOWN_WIDTHS``): its tile's steps divide those two whole, and every step of a product whose columns they do
not divide is bounds-checked: a wider product that takes less time says what the checks cost. ``--all`` runs
the three ways in turns ``OUTER`` times, appends each process's line to ``$OUT/probe-x-ready.jsonl`` with its load
averages, and prints each way's medians over all runs. ``scripts/probe_sass_loops.py --x-ways`` counts the same three ways' K steps without a GPU.
"""
import collections
import json
import os
import statistics
import subprocess
import sys

import triton
import triton.language as tl

from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant.kernels import dp2a

WAYS = ("built", "hoisted", "ready")
LAYERS, GS = 28, 128
# The integer-dot tiles an H100's step kept for the 4-bit layers (docs/results/probes/h100-4-bit-head)
# down's K: Qwen2-VL-2B's 8,960 is 8.75 of its tile's 1,024-column steps, so every step of it is bounds-checked
# (309 instructions a step, 283 with whole steps: scripts/probe_sass_loops.py --x-ways); 8,192 and 9,216 are whole
DOWN_WIDTHS = (8192, 8960, 9216)
TILES = {"qkv": td.PackedGemvConfig(8, 2048, 4, 4, idot=True), "o": td.PackedGemvConfig(8, 2048, 4, 4, idot=True),
         "gate_up": td.PackedGemvConfig(32, 256, 4, idot=True), "down": td.PackedGemvConfig(16, 1024, 4, 8, idot=True)}


@triton.jit
def _same_every_step(X, NORM_W, rk, K, rstd, PROLOGUE: tl.constexpr, dt: tl.constexpr, EVEN: tl.constexpr = False,
                     OK=None):
    """``hoisted``: x's values at columns ``rk`` as one number, whatever the columns."""
    return (tl.zeros(rk.shape, tl.float32) + rstd).to(dt)


@triton.jit
def _ready_made(words, X, NORM_W, first, inside, K, rstd, PROLOGUE: tl.constexpr, dt: tl.constexpr,
                EVEN: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """``ready``: :func:`triton_decode._integer_dot` for 4-bit words with x's integer form read, not made: eight
    4-byte values a word of x at ``NORM_W`` (four pairs of 16-bit integers, its scale, the sum of its integers, two
    unused), six of them read."""
    at = NORM_W.to(tl.pointer_type(tl.int32), bitcast=True) + (first // 8) * 8
    pairs02 = tl.load(at)
    pairs46 = tl.load(at + 1)
    pairs13 = tl.load(at + 2)
    pairs57 = tl.load(at + 3)
    scale = tl.load(at + 4).to(tl.float32, bitcast=True)
    xints = tl.load(at + 5).to(tl.float32, bitcast=True)
    dot = tl.full(words.shape, 0x4B400000, tl.int32)  # 1.5·2^23's bits, as _integer_dot starts
    even = words & 0x0F0F0F0F
    odd = (words >> 4) & 0x0F0F0F0F
    dot = dp2a(tl.broadcast_to(pairs02[None, :], words.shape), even, dot, False, ASM)
    dot = dp2a(tl.broadcast_to(pairs46[None, :], words.shape), even, dot, True, ASM)
    dot = dp2a(tl.broadcast_to(pairs13[None, :], words.shape), odd, dot, False, ASM)
    dot = dp2a(tl.broadcast_to(pairs57[None, :], words.shape), odd, dot, True, ASM)
    return dot.to(tl.float32, bitcast=True), scale, xints


def patch(way: str) -> None:
    """Make ``triton_decode``'s batch-1 packed product compile the ``way`` way (before its first compile in this
    process)."""
    if way not in WAYS:
        raise SystemExit(f"WAY must be one of {', '.join(WAYS)}, got {way!r}")
    if way == "hoisted":
        td._input_values = _same_every_step
    elif way == "ready":
        td._integer_dot = _ready_made


def one_way(way: str, rounds: int) -> dict:
    """Each product of a layer and their chain timed ``rounds`` times the ``way`` way, in this process."""
    import torch

    from edgeinfer.quant import kernels
    from edgeinfer.quant.launching import SplitWorkspace
    from edgeinfer.testing.products import QWEN2_VL_2B, layer_calls, layer_case

    patch(way)
    dev = torch.device("cuda")
    res = {"way": way, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "layers": LAYERS, "group": GS, "rounds": rounds, "loadavg_before": os.getloadavg(), "products": {}}
    torch.manual_seed(0)
    space = SplitWorkspace(dev)
    calls = {}
    for name, n, k, kind in QWEN2_VL_2B:
        x, kw, ws, outs = layer_case(kind, n, k, dev, LAYERS, GS, 4)
        if way == "ready" and "norm_weight" in kw:  # room for 2k 4-byte values (a step may pass k) at the norm weight
            kw["norm_weight"] = torch.rand(4 * k, device=dev).to(x.dtype)[:k]
        calls[name] = layer_calls(x, ws, TILES[name], outs, space, **kw)
        runs = [kernels.graph_time_us(calls[name], 10) for _ in range(rounds)]
        res["products"][name] = {"tile": td._config_name(TILES[name]), "runs": [round(t, 2) for t in runs]}
    chain = [f for layer in zip(*(calls[name] for name, *_ in QWEN2_VL_2B)) for f in layer]
    res["chain_us_a_layer"] = [round(kernels.graph_time_us(chain, 10) * len(chain) / LAYERS, 2) for _ in range(rounds)]
    if way == "built":  # down at widths its 1,024-column steps divide and at its own, which they do not
        del calls, chain
        res["down_widths"] = {}
        for k in DOWN_WIDTHS:
            x, kw, ws, outs = layer_case("residual", 1536, k, dev, LAYERS, GS, 4)
            widths = layer_calls(x, ws, TILES["down"], outs, space, **kw)
            res["down_widths"][str(k)] = [round(kernels.graph_time_us(widths, 10), 2) for _ in range(rounds)]
            del x, kw, ws, outs, widths
    res["loadavg_after"] = os.getloadavg()
    return res


def all_ways(outer: int, rounds: int) -> None:
    """The three ways in turns, ``outer`` times, each in its own process; each way's medians over all its runs."""
    out = os.path.join(os.environ.get("OUT", "."), "probe-x-ready.jsonl")
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    for _ in range(outer):
        for way in WAYS:
            done = subprocess.run([sys.executable, __file__], env={**os.environ, "WAY": way, "ROUNDS": str(rounds)},
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{way}: exit {done.returncode}\n{done.stderr[-2000:]}")
            line = done.stdout.strip().splitlines()[-1]
            with open(out, "a") as f:
                f.write(line + "\n")
            res = json.loads(line)
            for name, entry in res["products"].items():
                runs[way][name] += entry["runs"]
            runs[way]["chain (a layer)"] += res["chain_us_a_layer"]
            for k, times in res.get("down_widths", {}).items():
                runs[way][f"down at K {k}"] += times
    for way, by in runs.items():
        print(way, json.dumps({name: round(statistics.median(v), 2) for name, v in by.items()}), flush=True)


if __name__ == "__main__":
    if "--all" in sys.argv:
        all_ways(int(os.environ.get("OUTER", "3")), int(os.environ.get("ROUNDS", "3")))
    else:
        print(json.dumps(one_way(os.environ.get("WAY", "built"), int(os.environ.get("ROUNDS", "3")))), flush=True)
