#!/usr/bin/env bash
# Which loads start torch.compile's compile workers (0b9ec3a): the demo model loaded on the cuda profile with
# runtime.capture_budget_s=20 (start-up captures: workers started at once, stopped once up) and =0 (left to torch), each
# in its own process: the processes beside ours when the load ends and after one request, the load's parts, the answer.
set -u
T0=$(date +%s)
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
R=/tmp/rec; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
for budget in ${BUDGETS:-20 0}; do
  PYTHONPATH=/tmp/site:$PWD BUDGET=$budget timeout 150 python3 - >> $R/loads.jsonl 2>> $R/loads.err <<'PY'
import json, os, time
from pathlib import Path
from PIL import Image
from edgeinfer.demo import DEMO_MODEL_DIR
from edgeinfer.engine import Engine, SamplingParams

def children():
    me, out = str(os.getpid()), []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2:].split()[1] == me:
                out.append(int(p.name))
    return out

budget = float(os.environ["BUDGET"])
t = time.perf_counter()
engine = Engine.load(DEMO_MODEL_DIR, profile=os.environ.get("PROFILE", "cuda"), overrides=[f"runtime.capture_budget_s={budget:g}"])
res = {"capture_budget_s": budget, "load_s": round(time.perf_counter() - t, 2),
       "load_timings": {k: round(v, 2) for k, v in engine.load_timings.to_dict().items()}, "children_after_load": children()}
out = engine.generate("What color is the circle?", [Image.open("examples/demo.jpg")], SamplingParams(max_new_tokens=8))
res.update(text=out.text, children_after_request=children(), at_s=round(time.perf_counter() - t, 2))
print(json.dumps(res))
PY
  echo "budget $budget rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
  tar czf $OUT/rec.tgz -C $R .
done
cat $R/loads.jsonl; tail -5 $R/loads.err; cat $R/gpu.txt
