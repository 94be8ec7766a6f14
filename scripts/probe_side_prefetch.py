"""Diagnostic probe (not a benchmark): does the batch-1 step get faster when a kernel on a side
stream of its CUDA graph asks the L2 cache for each layer's gate|up and ``down`` weights while
the layer's q|k|v product, attention and ``o`` run?

Those three are bound by their chains of waits, and the memory idles under them; gate|up and
``down`` (about 88% of a 4-bit layer's bytes) are bound by how long their loads take to come
back. The read-ahead taken out at 247768a asked for the same bytes from inside the attention
kernel, on its few programs, and made the step slower; here the requests come from a kernel of
their own, on many programs, that nothing on the step's chain waits for (the graph joins it at
the step's end). One ``prefetch.global.L2`` a 128-byte line (``line``), or one
``cp.async.bulk.prefetch.L2`` a 4 KB chunk (``bulk``).

The engine's tiles are chosen as a load chooses them (alone, then 8 s in the step), without the
side kernel. Every variant is then timed as the tuner times a step (two steps a graph, a past of
1,024 positions), all variants in turns, ``--rounds`` times; medians. Last, the step's outputs
with and without the side kernel are compared (they must be equal: it only reads).

Before that, each product alone is timed cold (the 28 layers' weights in turn, from memory) and
hot (the first layer's weights 28 times, from L2): what the weights in L2 are worth at most, at
each of ``--rows`` (more than one row: the layers' plain product beside cuBLAS on the weights
dequantized to bf16). ``--no-step`` stops there.

    python scripts/probe_side_prefetch.py --model DIR --rounds 7 --out probe.json
    python scripts/probe_side_prefetch.py --model DIR --rounds 5 --no-step --rows 1,4,16
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from edgeinfer.backends.torch import step_tuning
from edgeinfer.bench.raw import print_and_save
from edgeinfer.engine import Engine, EngineConfig
from edgeinfer.quant.kernels import graph_time_us

LINE = 128  # bytes a prefetch.global.L2 asks for
CHUNK = 4096  # bytes a bulk prefetch asks for


@triton.jit
def _prefetch(A, B, C, D, a_bytes, b_bytes, c_bytes, d_bytes, STEP: tl.constexpr, BULK: tl.constexpr,
              LANES: tl.constexpr):
    """Asks L2 for the bytes of A..D (uint8 pointers), STEP bytes a request, requests dealt to all
    programs' threads in turn. Nothing is loaded into registers and nothing waits."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES).to(tl.int64)
    lanes = tl.num_programs(0) * LANES
    for t in tl.static_range(4):
        if t == 0:
            base, nbytes = A, a_bytes
        elif t == 1:
            base, nbytes = B, b_bytes
        elif t == 2:
            base, nbytes = C, c_bytes
        else:
            base, nbytes = D, d_bytes
        requests = tl.cdiv(nbytes, STEP)
        for first in range(0, requests, lanes):
            r = first + lane
            size = tl.maximum(tl.minimum(nbytes - r * STEP, STEP), 0).to(tl.int32)
            if BULK:
                tl.inline_asm_elementwise(
                    "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t"
                    "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.b32 $0, 0;\n\t}",
                    "=r,l,r", [base + r * STEP, size], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t"
                    "@p prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;\n\t}",
                    "=r,l,r", [base + r * STEP, size], dtype=tl.int32, is_pure=False, pack=1)


def _bytes_of(t: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    if t is None:
        return torch.empty(16, dtype=torch.uint8, device="cuda"), 0
    flat = t.contiguous().view(-1).view(torch.uint8)
    return flat, flat.numel()


def layer_tensors(layer, which: str) -> list[torch.Tensor]:
    """The tensors of a layer's products the side kernel asks for: codes and scales."""
    names = {"gate_up+down": ("gate_up_t", "down_t"), "gate_up": ("gate_up_t",)}[which]
    out = []
    for name in names:
        w = getattr(layer, name)
        out += [w.codes, w.scales] if hasattr(w, "codes") else [w]
    return out


class SidePrefetch:
    """Wraps a FusedDecode's per-layer products so that each layer forks a prefetch kernel onto
    a side stream (before its q|k|v product, or after it) and the head joins it back."""

    def __init__(self, fused, *, where: str, programs: int, bulk: bool, which: str) -> None:
        self.fused, self.where, self.programs, self.bulk = fused, where, programs, bulk
        self.side = torch.cuda.Stream()
        self.args = {id(layer): self._args(layer_tensors(layer, which)) for layer in fused.decoder.layers}
        self.qkv, self.head = fused._qkv, fused._head_gemv

    @staticmethod
    def _args(tensors: list[torch.Tensor]) -> tuple:
        pairs = [_bytes_of(t) for t in tensors] + [_bytes_of(None)] * (4 - len(tensors))
        return tuple(p for p, _ in pairs) + tuple(n for _, n in pairs)

    def launch(self, layer) -> None:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            _prefetch[(self.programs,)](*self.args[id(layer)], STEP=CHUNK if self.bulk else LINE, BULK=self.bulk,
                                         LANES=128, num_warps=4)

    def install(self) -> None:
        def qkv(product, layer, x):
            if self.where == "before q|k|v":
                self.launch(layer)
            y = self.qkv(product, layer, x)
            if self.where == "after q|k|v":
                self.launch(layer)
            return y

        def head(x):
            y = self.head(x)
            torch.cuda.current_stream().wait_stream(self.side)
            return y

        self.fused._qkv, self.fused._head_gemv = qkv, head

    def remove(self) -> None:
        self.fused._qkv, self.fused._head_gemv = self.qkv, self.head


def products_cold_and_hot(fused, rounds: int, rows: int = 1) -> dict:
    """What a product's weights in L2 would be worth at most: each product alone, over every
    layer's weights in turn (from memory, as the step reads them) and over the first layer's
    weights as many times (from L2 after the first: each fits), in turns; medians of ``rounds``
    timings, µs a call. One row: the batch-1 step's kernel with the engine's tile and what it
    fuses. More rows: the plain product as the layers call it (``PackedMatrix.matmul``, its tile
    timed on first use), and beside it cuBLAS on the dequantized bf16 weights (``dense_cold``,
    ``dense_hot``: the bf16 engine's product, 2 bytes a weight)."""
    dtype = fused.decoder.norm.weight.dtype
    out = {}
    for name, (weights, x, kw, outs) in fused.timed_products().items():
        if name == "lm_head":
            continue
        if rows == 1:  # the step's kernel, with what it fuses, as the tuner times it
            tile, o = fused.configs[name], outs[0]
            calls = {"cold": [lambda w=w: fused._product(x, w, tile, out=o, **kw) for w in weights],
                     "hot": [lambda: fused._product(x, weights[0], tile, out=o, **kw)] * len(weights)}
        else:
            x = torch.randn(rows, x.shape[1], dtype=dtype, device=x.device)
            dense = [w.dequantize(dtype) for w in weights]
            calls = {"cold": [lambda w=w: w.matmul(x) for w in weights],
                     "hot": [lambda: weights[0].matmul(x)] * len(weights),
                     "dense_cold": [lambda w=w: torch.mm(x, w.t()) for w in dense],
                     "dense_hot": [lambda: torch.mm(x, dense[0].t())] * len(weights)}
        times = {label: [] for label in calls}
        for _ in range(rounds):
            for label, fns in calls.items():
                times[label].append(graph_time_us(fns))
        out[name] = {label: round(statistics.median(ts), 2) for label, ts in times.items()}
        out[name]["mb"] = round(weights[0].nbytes / 1e6, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-step", action="store_true", help="only the products alone, cold and hot")
    parser.add_argument("--rows", default="1", help="rows of the products timed cold and hot, comma-separated")
    args = parser.parse_args()
    load_before = os.getloadavg()
    config = EngineConfig(dtype="bfloat16", device="cuda", max_batch_size=1, block_size=16, kv_budget_mb=1024,
                          max_context=4096, cuda_graphs=True, prefix_cache=False, step_tuning_s=8.0)
    engine = Engine.load(args.model, config=config)
    fused = engine.decoder_engine._fused
    products = {rows: products_cold_and_hot(fused, args.rounds, int(rows)) for rows in args.rows.split(",")}
    print(products, flush=True)
    if args.no_step:
        print_and_save({"gpu": torch.cuda.get_device_name(), "load_before": load_before, "products": products,
                        "tiles": {k: str(v) for k, v in fused.configs.items()}}, args.out)
        return
    step = fused._scratch_step(step_tuning.STEP_TUNING_CONTEXT)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {"none": None}
    for where in ("before q|k|v", "after q|k|v"):
        for programs in (sms // 4, sms):
            variants[f"line, {where}, {programs} programs"] = dict(where=where, programs=programs, bulk=False,
                                                                    which="gate_up+down")
    variants[f"bulk, before q|k|v, {sms} programs"] = dict(where="before q|k|v", programs=sms, bulk=True,
                                                           which="gate_up+down")
    variants[f"line, before q|k|v, {sms} programs, gate|up only"] = dict(where="before q|k|v", programs=sms,
                                                                         bulk=False, which="gate_up")
    sides = {label: SidePrefetch(fused, **kw) for label, kw in variants.items() if kw is not None}
    out = {"model": str(args.model), "gpu": torch.cuda.get_device_name(), "l2_bytes":
           torch.cuda.get_device_properties(0).L2_cache_size, "load_before": load_before,
           "tiles": {k: str(v) for k, v in fused.configs.items()}, "step_report": fused.step_report,
           "products": products,
           "bytes_a_layer": {label: sum(a for a in s.args[id(fused.decoder.layers[0])][4:]) for label, s in sides.items()}}
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(args.rounds):
        for label in variants:
            side = sides.get(label)
            if side is not None:
                side.install()
            try:
                times[label].append(step_tuning.step_time_us(step))
            finally:
                if side is not None:
                    side.remove()
        print({k: round(v[-1], 1) for k, v in times.items()}, flush=True)
    out["us"] = {label: [round(t, 1) for t in ts] for label, ts in times.items()}
    out["median_us"] = {label: round(statistics.median(ts), 1) for label, ts in times.items()}
    base = out["median_us"]["none"]
    out["over_none"] = {label: round(us / base, 4) for label, us in out["median_us"].items()}
    # the side kernel only reads: the step's logits are the same with it
    torch.manual_seed(0)
    plain = step()[0].clone()
    first = next(iter(sides.values()))
    first.install()
    try:
        with_side = step()[0].clone()
        torch.cuda.synchronize()
    finally:
        first.remove()
    out["same_logits"] = bool(torch.equal(plain, with_side))
    out["load_after"] = os.getloadavg()
    print_and_save(out, args.out)


if __name__ == "__main__":
    main()
