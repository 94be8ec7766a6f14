"""Read-ahead budget sweep: one engine, fixed tiles (descended without read-ahead), the step timed
in turns with the layers' read-ahead planned at several shares of L2."""
import json, os, statistics, sys, time
from pathlib import Path
import torch
from edgeinfer.bench.common import bench_checkpoint
from edgeinfer.bench.weights import format_checkpoint
from edgeinfer.backends.torch import step_tuning, triton_decode
from edgeinfer.engine import Engine, EngineConfig
from edgeinfer.progress import NoSteps
import edgeinfer.quant.kernels as K

out = {"gpu": torch.cuda.get_device_name(), "load_before": os.getloadavg(), "l2": torch.cuda.get_device_properties(0).L2_cache_size}
cache = Path("/tmp/cache")
t0 = time.time()
src = bench_checkpoint("qwen2-vl-2b", cache)
model = format_checkpoint(src, "w4a16-h8", cache, 128, "bfloat16")
out["build_s"] = round(time.time() - t0, 1)
config = EngineConfig(dtype="bfloat16", device="cuda", max_batch_size=1, block_size=16, kv_budget_mb=1024,
                      max_context=4096, cuda_graphs=True, prefix_cache=False, step_tuning_s=0.0)
engine = Engine.load(model, config=config)
fused = engine.decoder_engine._fused
ranked = fused._tune_alone(NoSteps())
fused.configs = {n: t[0] for n, t in ranked.items()}
fused.read_ahead = None
fused._tune_in_step(ranked, 8.0, NoSteps())
out["tiles"] = {k: triton_decode._config_name(v) for k, v in fused.configs.items()}
out["step_report"] = fused.step_report
print(json.dumps(out), flush=True)
shares = [float(s) for s in sys.argv[1].split(",")]
plans = {}
for s in shares:
    K.READ_AHEAD_SHARE = s
    if s == 0:
        plans[s] = None
    else:
        fused.plan_read_ahead()
        plans[s] = fused.read_ahead
        out.setdefault("mb_per_layer", {})[str(s)] = round(max(sum(n for _, n in r) for r in fused._read_ahead_plan[1]) / 1e6, 2)
step = fused._scratch_step(step_tuning.STEP_TUNING_CONTEXT)
times = {s: [] for s in shares}
for s in shares:  # compile each once
    fused.read_ahead = plans[s]; step(); torch.cuda.synchronize()
reps = int(sys.argv[2])
for r in range(reps):
    for s in (shares if r % 2 == 0 else shares[::-1]):
        fused.read_ahead = plans[s]
        times[s].append(step_tuning.step_time_us(step))
    print(r, {s: round(t[-1], 1) for s, t in times.items()}, flush=True)
out["us"] = {str(s): [round(t, 1) for t in ts] for s, ts in times.items()}
out["median_us"] = {str(s): round(statistics.median(ts), 1) for s, ts in times.items()}
out["load_after"] = os.getloadavg()
print(json.dumps(out["median_us"]))
Path(os.environ["OUT"], "sweep.json").write_text(json.dumps(out, indent=1))
