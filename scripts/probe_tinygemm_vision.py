"""Diagnostic probe (not a benchmark): the 4-bit and 8-bit products beside PyTorch's int4 kernel,
and Qwen2-VL-2B's vision tower, on a GPU.

    OUT=folder python scripts/probe_tinygemm_vision.py

* ``tinygemm_semantics``: which dequantization rule ``torch.ops.aten._weight_int4pack_mm``
  applies (its output for an identity input is the dequantized weight), per inner k tile count;
* ``products``: each product of a Qwen2-VL-2B layer (no prologue, g128 scales) at 1 and 16 rows:
  bf16 through cuBLAS and our GEMV, W4 and W8 through our kernels (the fastest GEMV tile), W4
  through tinygemm, W8 through inductor (``linear(x, w.to(bf16)) * s``), eight weight copies
  cycled so that reads come from memory; microseconds a call, 20 calls replayed from one graph;
* ``vision``: the tower (random weights, bf16) for one to four 1024x768 pictures, its graph as
  written against compiled and captured, and the uncompiled graph's top kernels;
* ``packed_op_graph``: the packed product compiled with ``fullgraph`` and replayed from a CUDA
  graph, against the dequantized weight.

Writes ``$OUT/probe1.json``; the run the docs cite is docs/results/probes/h200-products-tinygemm-vision.json.
"""
import itertools, json, os, time, traceback
import torch
import torch.nn.functional as F
OUT = os.environ.get("OUT", "/tmp")
res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
dev = torch.device("cuda")
bf = torch.bfloat16

def gtime(fn, calls=20, repeats=5):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / calls)
    ts.sort()
    return ts[len(ts) // 2]

def section(name):
    def deco(f):
        t0 = time.time()
        try:
            res[name] = f()
        except Exception:
            res[name] = {"error": traceback.format_exc()[-3000:]}
        res.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        json.dump(res, open(f"{OUT}/probe1.json", "w"), indent=1)
        print(name, json.dumps(res[name])[:4000], flush=True)
    return deco

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
COPIES = 8  # distinct weights per product so that reads come from HBM, not L2

@section("tinygemm_semantics")
def _():
    n, k, gs = 256, 512, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
    w8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    out = {}
    for itk in (2, 4, 8):
        packed = torch.ops.aten._convert_weight_to_int4pack(w8, itk)
        s = torch.rand(k // gs, n, device=dev, dtype=torch.float32) * 0.01 + 0.001
        z = torch.randn(k // gs, n, device=dev, dtype=torch.float32) * 0.01
        sz = torch.stack([s, z], -1).to(bf)
        eye = torch.eye(k, dtype=bf, device=dev)
        wt = torch.ops.aten._weight_int4pack_mm(eye, packed, gs, sz)  # [k, n] = W^T
        g = torch.arange(k, device=dev) // gs
        sb, zb = sz[..., 0].float(), sz[..., 1].float()
        hyp = {"(q-8)*s+z": ((q.float() - 8) * sb[g].t() + zb[g].t()),
               "(q-8)*s-z": ((q.float() - 8) * sb[g].t() - zb[g].t()),
               "q*s+z": (q.float() * sb[g].t() + zb[g].t())}
        out[itk] = {h: float((wt.float().t() - r).abs().max()) for h, r in hyp.items()}
        out[itk]["shape"] = list(wt.shape)
    return out

def packed(n, k, bits, gs):
    from edgeinfer.quant.packed import PackedMatrix
    per = 32 // bits
    codes = torch.randint(-2**31, 2**31 - 1, (n, k // per), dtype=torch.int32, device=dev)
    scales = (torch.rand(n, k // gs, device=dev) * 0.01 + 0.001).to(bf)
    return PackedMatrix(codes, scales, None, bits, gs, (n, k))

def cycled(call, copies):
    """A function calling ``call`` on the next of ``copies`` at each call: a captured run of calls
    reads a different weight each time, from memory rather than the L2 cache."""
    it = itertools.cycle(copies)
    return lambda: call(next(it))


def fastest(candidates, call, copies):
    """The fastest candidate tile for ``call(copy, config)`` and its microseconds."""
    times = {c: gtime(cycled(lambda w, c=c: call(w, c), copies)) for c in candidates}
    best = min(times, key=times.get)
    return best, times[best]


@section("products")
def _():
    from edgeinfer.backends.torch import triton_decode as td
    out = {}
    for name, (n, k) in SHAPES.items():
        r = {}
        dense = [torch.randn(n, k, dtype=bf, device=dev) * 0.02 for _ in range(COPIES)]
        for m in (1, 16):
            x = torch.randn(m, k, dtype=bf, device=dev)
            r[f"bf16_cublas_m{m}"] = gtime(cycled(lambda w: x @ w.t(), dense))
        x1 = torch.randn(1, k, dtype=bf, device=dev)
        c, r["bf16_triton_m1"] = fastest(td.GEMV_CANDIDATES, lambda w, c: td.gemv(x1, w, config=c), dense)
        r["bf16_triton_cfg"] = str(c)
        del dense
        x16 = torch.randn(16, k, dtype=bf, device=dev)
        split_ws = td.SplitWorkspace(dev)
        for bits in (4, 8):
            ws = [packed(n, k, bits, 128) for _ in range(COPIES)]
            c, r[f"w{bits}_triton_m1"] = fastest(td.PACKED_GEMV_CANDIDATES, lambda w, c: td.packed_gemv(x1, w, c, workspace=split_ws), ws)
            r[f"w{bits}_triton_cfg"] = str(c)
            r[f"w{bits}_packed_mm_m16"] = gtime(cycled(lambda w: w.matmul(x16), ws))
            del ws
        # tinygemm
        w8s = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev) for _ in range(COPIES)]
        for itk in (2, 4, 8):
            try:
                pk = [(torch.ops.aten._convert_weight_to_int4pack(w, itk),
                       torch.randn(k // 128, n, 2, dtype=bf, device=dev) * 0.01) for w in w8s]
                for m in (1, 16):
                    x = torch.randn(m, k, dtype=bf, device=dev)
                    r[f"tinygemm_itk{itk}_m{m}"] = gtime(cycled(
                        lambda w: torch.ops.aten._weight_int4pack_mm(x, w[0], 128, w[1]), pk))
            except Exception as exc:
                r[f"tinygemm_itk{itk}"] = repr(exc)[:300]
        # int8 weight-only through inductor (gpt-fast style)
        try:
            w8 = [(torch.randint(-127, 127, (n, k), dtype=torch.int8, device=dev),
                   torch.rand(n, dtype=bf, device=dev) * 0.01) for _ in range(COPIES)]
            torch._inductor.config.coordinate_descent_tuning = True
            lin = torch.compile(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s)
            for m in (1, 16):
                x = torch.randn(m, k, dtype=bf, device=dev)
                for w, scale in w8:
                    lin(x, w, scale)
                r[f"w8_inductor_m{m}"] = gtime(cycled(lambda w: lin(x, *w), w8))
        except Exception as exc:
            r["w8_inductor"] = repr(exc)[:300]
        r["bf16_MB"] = n * k * 2 / 1e6
        out[name] = {kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items()}
        print(name, out[name], flush=True)
    return out

@section("vision")
def _():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from edgeinfer.models.qwen2_vl import QwenVisionEncoder
    cfg = Qwen2VLConfig(vision_config=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536,
                                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
    vc = cfg.vision_config
    vc._attn_implementation = "sdpa"
    visual = Qwen2VisionTransformerPretrainedModel._from_config(vc, dtype=bf).to(dev).eval()
    enc = QwenVisionEncoder(visual).eval()
    out = {}
    def inputs(nimg):
        grid = torch.tensor([[1, 54, 74]] * nimg)
        return {"pixel_values": torch.randn(int(grid.prod(-1).sum()), 1176, device=dev),
                "image_grid_thw": grid}
    def mean_ms(fn, times=5):
        torch.cuda.synchronize()
        s = time.time()
        for _ in range(times):
            fn()
        torch.cuda.synchronize()
        return (time.time() - s) / times * 1e3

    def graph_of(module, t):  # ``module`` on static copies of ``t``, warmed, then captured
        static = {k: v.clone() if v.is_cuda else v for k, v in t.items()}
        for _ in range(2):
            module(**static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            module(**static)
        g.replay()
        return g

    with torch.inference_mode():
        # The tower as written, captured (what TorchVisionEngine replayed at the run's tree).
        graphs = {nimg: graph_of(enc, inputs(nimg)) for nimg in (1, 2, 4)}
        for nimg, g in graphs.items():
            out[f"graph_eager_{nimg}img_ms"] = mean_ms(g.replay)
        t = inputs(1)
        comp = torch.compile(enc, dynamic=False)
        for _ in range(3):
            comp(**t)
        out["compiled_1img_ms"] = mean_ms(lambda: comp(**t))
        out["compiled_graph_1img_ms"] = mean_ms(graph_of(comp, t).replay)  # compiled, then captured
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graphs[1].replay()
            torch.cuda.synchronize()
        out["eager_top"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
    return out

@section("packed_op_graph")
def _():
    w = packed(2048, 1536, 4, 128)
    ref = w.dequantize(bf)
    fn = torch.compile(lambda x: w.matmul(x), fullgraph=True)
    out = {}
    for m in (1, 4, 16, 100):
        x = torch.randn(m, 1536, dtype=bf, device=dev)
        y = fn(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y2 = fn(x)
        g.replay(); torch.cuda.synchronize()
        out[m] = {"eager_vs_ref": float((y.float() - (x @ ref.t()).float()).abs().max()),
                  "graph_vs_eager": float((y2.float() - y.float()).abs().max())}
    return out

print("done")
