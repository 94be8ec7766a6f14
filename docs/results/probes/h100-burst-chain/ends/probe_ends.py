"""The batch-1 4-bit burst step with its ends against the tuner's step (layers and head), both two steps a graph."""
import json, os, sys, statistics
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
from edgeinfer.bench.common import bench_checkpoint, bench_image
from edgeinfer.bench.gpu import QUESTION, ours_config
from edgeinfer.bench.weights import format_checkpoint
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.backends.torch.step_tuning import step_time_us
from profile_gpu import at_batch

out = Path(sys.argv[1])
cache = Path("/tmp/cache")
model = format_checkpoint(bench_checkpoint("qwen2-vl-2b", cache), "w4a16-h8", cache, 128, "bfloat16")
engine = Engine.load(model, config=ours_config("bfloat16", "cuda", (1024, 768), 16))
img = bench_image((1024, 768), seed=0)
for _ in range(2):
    engine.vision_cache.clear()
    engine.run_until_done([engine.submit(QUESTION, [img], SamplingParams(max_new_tokens=64, ignore_eos=True))])
d = engine.decoder_engine
f = d._fused
g = at_batch(d._bursts, 1)
k, v = engine.kv.k, engine.kv.v
ctx = int(g.context_lens[0])
scratch = f._scratch_step(ctx)
ends = f.ends
zeros = torch.zeros_like(g.valid)
ids = torch.empty_like(g.tokens)

def layers_only():  # the burst's own buffers and pool, no ends
    x, cos, sin = xcs
    f.layers(x, cos, sin, k, v, g.tables, g.context_lens, zeros)

xcs = ends.inputs(g.tokens, g.positions)
def with_inputs():
    x, cos, sin = ends.inputs(g.tokens, g.positions)
    f.layers(x, cos, sin, k, v, g.tables, g.context_lens, zeros)
def with_choose():
    x, cos, sin = xcs
    logits, _, _ = f.layers(x, cos, sin, k, v, g.tables, g.context_lens, zeros)
    ends.choose(logits, ids)
def burst_step():
    d._burst_step(g.tokens, g.positions, k, v, g.tables, g.context_lens, g.valid, None, write=False)

rep = {"gpu": torch.cuda.get_device_name(), "context": ctx}
variants = {"tuner_scratch_step": scratch, "layers_on_burst_buffers": layers_only, "with_inputs": with_inputs,
            "with_choose": with_choose, "burst_step": burst_step}
times = {n: [] for n in variants}
for r in range(5):
    for n, fn in variants.items():
        times[n].append(step_time_us(fn))
rep["us_median_of_5"] = {n: round(statistics.median(t), 2) for n, t in times.items()}
rep["us_all"] = {n: [round(x, 2) for x in t] for n, t in times.items()}
rep["one_step_a_graph_burst_step"] = round(step_time_us(burst_step, steps_a_graph=1), 2)
g.replay(); torch.cuda.synchronize()
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
for _ in range(50): g.replay()
e1.record(); torch.cuda.synchronize()
rep["burst_graph_replays_us"] = round(e0.elapsed_time(e1) / 50 * 1e3, 2)
rep["step_report"] = d.kernel_report.get("step")
out.write_text(json.dumps(rep, indent=1))
print(json.dumps(rep, indent=1))
