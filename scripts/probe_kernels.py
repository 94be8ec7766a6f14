"""Diagnostic probe (not a benchmark): where a decode step's time goes on a GPU, per kernel.

    python scripts/probe_kernels.py sampler,gemv

* ``sampler``: the device sampler's cost per step (one CUDA graph of the call, 20 replays) at
  1 and 16 rows of a 151,936-token vocabulary, greedy against temperature / top-p / top-k /
  min-p / penalties, and its pieces (sort, softmax, running sum);
* ``gemv``: the 4-bit batch-1 products of a Qwen2-VL-2B layer (no prologue) through the fused
  step's kernel, against bf16 (ours and cuBLAS) and two other kernel layouts tried here
  (a [rows, words, 8] unpack, and one scale per 128-column group).

Each product of the fused batch-1 step with its prologue, per format and tile, is
``scripts/probe_packed_products.py`` (this script's ``prod``, which Run 2 of
``h200-kernels-sampler.txt`` ran at 246c65f, moved there).

Outputs of the runs the docs cite are in docs/results/probes/.
"""
import sys, json, itertools, traceback
import torch
import triton
import triton.language as tl
from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.backends.torch.triton_decode import graph_time_us
from edgeinfer.quant.packed import PackedMatrix, _pack_columns

which = sys.argv[1].split(",") if len(sys.argv) > 1 else ["sampler", "gemv"]
import os
dev = os.environ.get("LAB_DEV", "cuda")

if "sampler" in which:
    try:
        from edgeinfer.engine.sampling import SamplingParams, SamplingRows
        V = 151936
        for b in (1, 16):
            logits = torch.randn(b, V, device=dev) * 3
            greedy = graph_time_us([lambda: logits.argmax(-1)], repeats=20)
            out = {"argmax": greedy}
            for name, p in (("t0.7", SamplingParams(temperature=0.7, seed=1)),
                            ("t0.7 p0.9", SamplingParams(temperature=0.7, top_p=0.9, seed=1)),
                            ("t0.7 k50 p0.9 minp", SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=1)),
                            ("t0.7 p0.9 pen", SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, seed=1))):
                rows = SamplingRows((p,) * b, (1,) * b, ((1, 2, 3),) * b, ((),) * b)
                st = rows.state(V, dev)
                valid = torch.ones(b, dtype=torch.long, device=dev)
                out[name] = graph_time_us([lambda: st.next_ids(logits, valid)], repeats=20)
                # pieces
            scaled = logits / 0.7
            out["sort stable"] = graph_time_us([lambda: torch.sort(scaled, dim=-1, descending=True, stable=True)], repeats=20)
            out["sort"] = graph_time_us([lambda: torch.sort(scaled, dim=-1, descending=True)], repeats=20)
            out["topk1024"] = graph_time_us([lambda: torch.topk(scaled, 1024, dim=-1)], repeats=20)
            out["softmax"] = graph_time_us([lambda: scaled.softmax(-1)], repeats=20)
            out["cumsum"] = graph_time_us([lambda: scaled.cumsum(-1)], repeats=20)
            print("SAMPLER b", b, json.dumps({k: round(v, 1) for k, v in out.items()}), flush=True)
    except Exception:
        traceback.print_exc()


@triton.jit
def _tile_products(X, Q, rn, n_ok, k0, K, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr):
    """The codes of rows ``rn`` over columns k0 .. k0+BK unpacked as [BN, words, 32/b] and
    multiplied by x: (Σ over each word of q·x [BN, words], Σ over each word of x [words])."""
    PER: tl.constexpr = 32 // BITS
    W: tl.constexpr = BK // PER
    words_per_row = K // PER
    rw = k0 // PER + tl.arange(0, W)
    words = tl.load(Q + rn[:, None].to(tl.int64) * words_per_row + rw[None, :],
                    mask=n_ok[:, None] & (rw[None, :] < words_per_row), other=0)
    x2 = tl.load(X + k0 + tl.arange(0, W)[:, None] * PER + tl.arange(0, PER)[None, :],
                 mask=(k0 + tl.arange(0, W)[:, None] * PER) < K, other=0.0).to(tl.float32)
    sh = tl.arange(0, PER) * BITS
    q3 = ((words[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    return tl.sum(q3 * x2[None, :, :], axis=2), tl.sum(x2, axis=1)


@triton.jit
def _w4_gemv3d(X, Q, S, Z, Y, N, K, G, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr,
               GS: tl.constexpr, HAS_Z: tl.constexpr, SPLIT: tl.constexpr):
    """One scale per word: [BN, words] partial sums, reduced at the end."""
    PER: tl.constexpr = 32 // BITS
    W: tl.constexpr = BK // PER
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = rn < N
    acc = tl.zeros([BN, W], tl.float32)
    per_split = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    start = tl.program_id(1) * per_split
    for k0 in range(start, tl.minimum(start + per_split, K), BK):
        qx, xs = _tile_products(X, Q, rn, n_ok, k0, K, BN, BK, BITS)
        g = (k0 + tl.arange(0, W) * PER) // GS
        at = rn[:, None] * G + g[None, :]
        ok = n_ok[:, None] & (g[None, :] < G)
        s = tl.load(S + at, mask=ok, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(Z + at, mask=ok, other=0.0).to(tl.float32)
        else:
            z = 1 << (BITS - 1)
        acc += s * (qx - z * xs[None, :])
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=n_ok)
    else:
        tl.atomic_add(Y + rn, y, mask=n_ok, sem="relaxed")


@triton.jit
def _w4_gemv_grp(X, Q, S, Y, N, K, G, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr,
                 GS: tl.constexpr, SPLIT: tl.constexpr):
    """Scale applied per group after a [BN] accumulation over the group: BK == GS, symmetric."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = rn < N
    acc = tl.zeros([BN], tl.float32)
    per_split = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    start = tl.program_id(1) * per_split
    for k0 in range(start, tl.minimum(start + per_split, K), BK):
        qx, xs = _tile_products(X, Q, rn, n_ok, k0, K, BN, BK, BITS)
        s = tl.load(S + rn * G + k0 // GS, mask=n_ok, other=0.0).to(tl.float32)
        acc += s * (tl.sum(qx, axis=1) - (1 << (BITS - 1)) * tl.sum(xs, axis=0))
    if SPLIT == 1:
        tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=n_ok)
    else:
        tl.atomic_add(Y + rn, acc, mask=n_ok, sem="relaxed")


def packed(n, k, bits, gs):
    u = torch.randint(0, 1 << bits, (n, k), dtype=torch.int32)
    g = k // gs
    return PackedMatrix(_pack_columns(u, bits), (torch.rand(n, g) * 0.01).bfloat16(), None, bits, gs, (n, k)).to(dev)


if "gemv" in which:
    shapes = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
    for name, (n, k) in shapes.items():
        try:
            ws = [packed(n, k, 4, 128) for _ in range(28)]
            dense = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(28)]
            mb4 = ws[0].nbytes / 1e6
            mb16 = n * k * 2 / 1e6
            x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
            split_ws = td.SplitWorkspace(torch.device(dev))
            res = {}
            cub = graph_time_us([lambda w=w: torch.mm(x, w.t()) for w in dense])
            res["cublas bf16"] = (cub, mb16)
            t = {c: graph_time_us([lambda w=w, c=c: td.gemv(x, w, config=c) for w in dense]) for c in td.GEMV_CANDIDATES}
            c = min(t, key=t.get); res[f"ours bf16 {c.bn}x{c.bk}/{c.warps}"] = (t[c], mb16)
            t = {c: graph_time_us([lambda w=w, c=c: td.packed_gemv(x, w, c, workspace=split_ws) for w in ws])
                 for c in td.PACKED_GEMV_CANDIDATES}
            c = min(t, key=t.get); res[f"ours w4 now {c.bn}x{c.bk}/{c.warps}"] = (t[c], mb4)
            y16 = torch.empty(n, dtype=torch.bfloat16, device=dev)
            y32 = torch.zeros(n, dtype=torch.float32, device=dev)
            best = {}
            for bn, bk, warps, split in itertools.product((1, 2, 4, 8), (128, 256, 512, 1024), (2, 4, 8), (1, 2, 4)):
                if bn * bk > 8192 or (split > 1 and k < bk * split):
                    continue
                grid = (triton.cdiv(n, bn), split)
                for kern in ("3d", "grp"):
                    if (kern == "grp") != (bk == 128):
                        continue
                    def call(w, y=(y16 if split == 1 else y32)):
                        if kern == "3d":
                            _w4_gemv3d[grid](x, w.codes, w.scales, w.scales, y, n, k, w.layout.groups, BN=bn, BK=bk,
                                             BITS=4, GS=128, HAS_Z=False, SPLIT=split, num_warps=warps)
                        else:
                            _w4_gemv_grp[grid](x, w.codes, w.scales, y, n, k, w.layout.groups, BN=bn, BK=bk,
                                               BITS=4, GS=128, SPLIT=split, num_warps=warps)
                    try:
                        us = graph_time_us([lambda w=w: call(w) for w in ws])
                    except Exception as e:
                        print("fail", kern, bn, bk, warps, split, str(e)[:200], flush=True)
                        continue
                    best[(kern, bn, bk, warps, split)] = us
            # check correctness of the best of each kind
            top = sorted(best, key=best.get)[:6]
            for key in top:
                kern, bn, bk, warps, split = key
                y32.zero_()
                grid = (triton.cdiv(n, bn), split)
                y = y16 if split == 1 else y32
                w = ws[0]
                if kern == "3d":
                    _w4_gemv3d[grid](x, w.codes, w.scales, w.scales, y, n, k, w.layout.groups, BN=bn, BK=bk, BITS=4, GS=128,
                                     HAS_Z=False, SPLIT=split, num_warps=warps)
                else:
                    _w4_gemv_grp[grid](x, w.codes, w.scales, y, n, k, w.layout.groups, BN=bn, BK=bk, BITS=4, GS=128,
                                       SPLIT=split, num_warps=warps)
                ref = (x.float() @ w.dequantize(torch.float32).t()).flatten()
                err = (y.float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-9)
                res[f"lab {key} relerr {err:.1e}"] = (best[key], mb4)
            print(f"GEMV {name} n={n} k={k}: " + "; ".join(f"{k_} {us:.1f}us {mb*1e3/us:.0f}GB/s" for k_, (us, mb) in res.items()), flush=True)
        except Exception:
            traceback.print_exc()
