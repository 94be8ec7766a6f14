"""Diagnostic probe (not a benchmark): the prompt path's dequantize kernel on a GPU, against the
kernel it replaced, on the products of a Qwen2-VL-2B layer at 4 and 8 bits (g128, bf16 scales).

    OUT=folder python scripts/probe_dequantize.py

``kernels.dequantize`` puts a tile's classes of columns (value ``i`` of every packed word) back
in column order in registers and stores the tile contiguous; the replaced kernel (kept here as
``_per_class``) stored each class on its own, every row written 32/b times a value at a time.
Microseconds a call (``triton.testing.do_bench``, its mean), the bytes moved per µs (packed
bytes read, bf16 bytes written), and whether both give the same weights. Writes
``$OUT/dequantize.json``; docs/results/probes/h200-dequantize.json is a run of it.
Since that run ``_per_class`` takes its codes from ``codes_less`` (``q - z`` in one step, the same
values as the ``codes_at(...) - z`` it had then).
"""
import json, os, torch
from triton.testing import do_bench
from edgeinfer.quant import kernels
from edgeinfer.quant.packed import PackedMatrix
import triton, triton.language as tl
from edgeinfer.quant.kernels import load_words, group_params, codes_less
dev = torch.device("cuda")

@triton.jit
def _per_class(Q, S, Z, W, N, K, G, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, HAS_Z: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    words = load_words(Q, rn, k0, N, K, BN, BK, BITS)
    s, z = group_params(S, Z, rn, k0, N, G, BN, BK, BITS, GS, HAS_Z)
    for i in tl.static_range(PER):
        rk = k0 + tl.arange(0, BK // PER) * PER + i
        w = (codes_less(words, i, BITS, z) * s).to(S.dtype.element_ty).to(W.dtype.element_ty)
        tl.store(W + rn[:, None].to(tl.int64) * K + rk[None, :], w, mask=(rn[:, None] < N) & (rk[None, :] < K))

def per_class(codes, sc, layout):
    w = torch.empty(layout.n, layout.k, dtype=torch.bfloat16, device=dev)
    bk = kernels._tile_k(layout, 128)
    _per_class[(triton.cdiv(layout.n, 32), triton.cdiv(layout.k, bk))](codes, sc, sc, w, layout.n, layout.k, layout.groups,
        BN=32, BK=bk, BITS=layout.bits, GS=layout.group_constexpr, HAS_Z=False, num_warps=4)
    return w

out = {}
for bits in (4, 8):
    for name, (n, k) in {"gate_up": (17920, 1536), "down": (1536, 8960), "qkv": (2048, 1536)}.items():
        codes = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), dtype=torch.int32, device=dev)
        sc = (torch.rand(n, k // 128, device=dev) * 0.01).bfloat16()
        w = PackedMatrix(codes, sc, None, bits, 128, (n, k))
        us = do_bench(lambda: kernels.dequantize(codes, sc, None, w.layout, torch.bfloat16), warmup=5, rep=50) * 1e3
        us_old = do_bench(lambda: per_class(codes, sc, w.layout), warmup=5, rep=50) * 1e3
        same = torch.equal(per_class(codes, sc, w.layout), kernels.dequantize(codes, sc, None, w.layout, torch.bfloat16))
        moved = n * k * 2 + w.nbytes
        out[f"w{bits}_{name}"] = {"us": round(us, 2), "gb_s": round(moved / us / 1e3, 1), "per_class_store_us": round(us_old, 2), "same": same}
print("dequantize", json.dumps(out))
json.dump(out, open(os.environ["OUT"] + "/dequantize.json", "w"))
