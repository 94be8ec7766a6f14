"""Where a batch-16 bench call's decode goes after its last row's first token, for one weight format:
the call itself (as `bench gpu` times it), its device timeline, the burst graph replayed back to back,
and the tuner's scratch step at 16 rows at 1,024 positions and at the call's own context."""
import json, os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
from edgeinfer.backends.torch.step_tuning import step_time_us
from edgeinfer.bench.common import bench_checkpoint, bench_image
from edgeinfer.bench.gpu import QUESTION, ours_config
from edgeinfer.bench.weights import format_checkpoint
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.engine.sequence import Status
from profile_gpu import timeline

fmt, out = sys.argv[1], Path(sys.argv[2])
B, N = 16, 64
cache = Path("/tmp/cache")
model = format_checkpoint(bench_checkpoint("qwen2-vl-2b", cache), fmt, cache, 128, "bfloat16")
engine = Engine.load(model, config=ours_config("bfloat16", "cuda", (1024, 768), B))
images = [bench_image((1024, 768), seed=i) for i in range(B)]
params = SamplingParams(max_new_tokens=N, ignore_eos=True)
rep = {"fmt": fmt, "gpu": torch.cuda.get_device_name(), "load_before": os.getloadavg()}


def call(profile=False):
    engine.vision_cache.clear()
    torch.cuda.synchronize()
    before = dict(engine.counters)
    started = time.perf_counter()
    seqs = [engine.submit(QUESTION, [im], params) for im in images]
    while any(not s.generated for s in seqs):
        engine.step()
    t_first = time.perf_counter()
    made_at_first = [len(s.generated) for s in seqs]
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile
        prof = tprofile(activities=[ProfilerActivity.CUDA]); prof.__enter__()
    steps_at = []  # host time of each step() after the first token, and what it returned
    while any(s.status is not Status.FINISHED for s in seqs):
        t0 = time.perf_counter()
        got = engine.step()
        steps_at.append((round((t0 - t_first) * 1e3, 3), round((time.perf_counter() - t0) * 1e3, 3), len(got)))
    for s in seqs:
        engine.result(s)
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    if prof is not None:
        prof.__exit__(None, None, None)
    counted = {k: engine.counters[k] - before.get(k, 0) for k in engine.counters}
    first_stamp = max(s.timings.first_token for s in seqs)
    return dict(in_call_us_a_step=(t_end - first_stamp) / (N - 1) * 1e6, loop_us_a_step=(t_end - t_first) / (N - 1) * 1e6,
                first_s=first_stamp - started, made_at_first=made_at_first, counted=counted, steps=steps_at,
                context=[s.num_cached for s in seqs], prof=prof, t_first=t_first, t_end=t_end)


for _ in range(2):
    call()
runs = [call() for _ in range(5)]
rep["in_call_us_a_step"] = [round(r["in_call_us_a_step"], 1) for r in runs]
rep["in_call_median_us"] = statistics.median(rep["in_call_us_a_step"])
rep["loop_us_a_step"] = [round(r["loop_us_a_step"], 1) for r in runs]
rep["first_s"] = [round(r["first_s"], 4) for r in runs]
rep["made_at_first"] = runs[-1]["made_at_first"]
rep["counted"] = runs[-1]["counted"]
rep["steps"] = runs[-1]["steps"]
rep["context_at_end"] = runs[-1]["context"]
print(json.dumps({k: rep[k] for k in ("fmt", "gpu", "in_call_us_a_step", "loop_us_a_step", "first_s", "made_at_first",
                                       "counted")}), flush=True)
print("steps (ms after first, ms in step, rows):", rep["steps"], flush=True)

import traceback


def save():
    out.write_text(json.dumps(rep, indent=1, default=str))


def profiled():
    r = call(profile=True)
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in r["prof"].events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    rep["timeline"] = t = timeline(spans, (r["t_end"] - r["t_first"]) * 1e6, N - 1, top=25)
    print({k: t[k] for k in ("wall_us_a_token", "busy_us_a_token", "span_us_a_token", "gap_us_a_token", "gaps_over_5us",
                             "gap_us_over_5us")}, flush=True)
    for g in t["longest"][:15]:
        print(g, flush=True)


def bursts():
    dec = engine.decoder_engine
    graphs = {k: g for k, g in getattr(dec, "_bursts", {}).items() if k[0] == B}
    rep["burst_keys"] = [str(k) for k in graphs]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for key, g in graphs.items():
        times = []
        for _ in range(3):
            g.replay(); torch.cuda.synchronize()
            e0.record()
            for _ in range(N - 1):
                g.replay()
            e1.record(); torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / (N - 1) * 1e3)
        rep.setdefault("burst_replay_us", {})[str(key)] = [round(x, 1) for x in times]
    print("burst replays back to back, us a step:", rep.get("burst_replay_us"), flush=True)


def scratch():
    fused = getattr(engine.decoder_engine, "_fused", None)
    if fused is None:
        return
    ctx = int(statistics.median(rep["context_at_end"])) - N
    steps = {c: fused._scratch_step(c, rows=B) for c in (1024, ctx)}
    times = {c: [] for c in steps}
    for _ in range(3):
        for c, st in steps.items():
            times[c].append(step_time_us(st))
    rep["scratch_step_us"] = {str(c): [round(x, 1) for x in ts] for c, ts in times.items()}
    print("scratch step at 16 rows, us:", rep["scratch_step_us"], flush=True)
    rep["rows_report"] = {str(k): v for k, v in getattr(fused, "rows_report", {}).items()}


save()
for part in (profiled, bursts, scratch):
    try:
        part()
    except Exception:
        rep.setdefault("errors", []).append(traceback.format_exc())
        traceback.print_exc()
    save()
rep["load_after"] = os.getloadavg()
save()
