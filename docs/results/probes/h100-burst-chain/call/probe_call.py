"""Where a bench call's decode goes (after its first token), for one weight format at batch 1."""
import cProfile, io, json, os, pstats, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
from edgeinfer.bench.common import bench_checkpoint, bench_image
from edgeinfer.bench.gpu import QUESTION, ours_config
from edgeinfer.bench.weights import format_checkpoint
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.engine.sequence import Status
from profile_gpu import timeline, kernel_table, at_batch

fmt, out = sys.argv[1], Path(sys.argv[2])
cache = Path("/tmp/cache")
model = format_checkpoint(bench_checkpoint("qwen2-vl-2b", cache), fmt, cache, 128, "bfloat16")
engine = Engine.load(model, config=ours_config("bfloat16", "cuda", (1024, 768), 16))
img = bench_image((1024, 768), seed=0)
params = SamplingParams(max_new_tokens=64, ignore_eos=True)

def call(hook=None):
    engine.vision_cache.clear()
    torch.cuda.synchronize()
    seqs = [engine.submit(QUESTION, [img], params)]
    while not seqs[0].generated:
        engine.step()
    t_first = time.perf_counter()
    ctx = hook() if hook else None
    if ctx: ctx.__enter__()
    while seqs[0].status is not Status.FINISHED:
        engine.step()
    engine.result(seqs[0])
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    if ctx: ctx.__exit__(None, None, None)
    return seqs[0], t_first, t_end

for _ in range(3):
    call()
rep = {"fmt": fmt, "gpu": torch.cuda.get_device_name()}
us = []
for _ in range(7):
    s, tf, te = call()
    us.append((te - tf) / 63 * 1e6)
    us.append((te - s.timings.first_token) / 63 * 1e6)
rep["us_a_token_after_loop_first"] = statistics.median(us[0::2])
rep["us_a_token_after_first_stamp"] = statistics.median(us[1::2])
rep["all"] = [round(u, 1) for u in us]
from torch.profiler import ProfilerActivity, profile
box = {}
def prof():
    box["p"] = profile(activities=[ProfilerActivity.CUDA])
    return box["p"]
s, tf, te = call(prof)
spans = [(e.time_range.start, e.time_range.end, e.name) for e in box["p"].events()
         if e.device_type == torch.autograd.DeviceType.CUDA]
rep["timeline"] = timeline(spans, (te - tf) * 1e6, 63, top=25)
first_kernel = min(sp[0] for sp in spans); last_kernel = max(sp[1] for sp in spans)
rep["kernel_span_us"] = last_kernel - first_kernel
pr = cProfile.Profile()
def cprof():
    class C:
        def __enter__(self): pr.enable()
        def __exit__(self, *a): pr.disable()
    return C()
call(cprof)
st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(30)
rep["host_top"] = st.getvalue().splitlines()[:50]
dec = engine.decoder_engine
rep["step_report"] = getattr(getattr(dec, "_fused", None), "step_report", None) or getattr(dec, "kernel_report", None)
burst = at_batch(getattr(dec, "_bursts", {}), 1)
if burst is not None:
    rep["burst_step_kernels"] = kernel_table(burst.replay, top=12)
    burst.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(63):
        burst.replay()
    e1.record(); torch.cuda.synchronize()
    rep["burst_replays_us"] = e0.elapsed_time(e1) / 63 * 1e3
    g = burst
    o = torch.empty(1, 63, dtype=torch.long, device="cuda")
    e0.record()
    for i in range(63):
        burst.replay(); o[:, i].copy_(g.tokens[:1])
    e1.record(); torch.cuda.synchronize()
    rep["burst_replays_with_copy_us"] = e0.elapsed_time(e1) / 63 * 1e3
rep["counters"] = dict(engine.counters)
out.write_text(json.dumps(rep, indent=1, default=str))
t = rep["timeline"]
print(json.dumps({k: rep[k] for k in ("fmt", "gpu", "us_a_token_after_loop_first", "us_a_token_after_first_stamp",
      "kernel_span_us", "burst_replays_us", "burst_replays_with_copy_us") if k in rep}, indent=1))
print({k: t[k] for k in ("wall_us_a_token", "busy_us_a_token", "span_us_a_token", "gap_us_a_token", "gaps_over_5us", "gap_us_over_5us")})
for g in t["longest"][:12]: print(g)
print("\n".join(rep["host_top"][:40]))
