#!/usr/bin/env bash
# The attention at 16 rows alone (probe pools against pools written), then the 4-bit batch-16 step's
# kernels without dependent launches (each kernel's own time).
set -u
T0=$(date +%s)
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
timeout 120 python3 docs/results/probes/h100-b16-final-norm/attention/first_probe.py > $OUT/attention.log 2>&1
echo "attention rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
EDGEINFER_DEPENDENT_LAUNCH=0 timeout $(( 570 - ($(date +%s) - T0) )) python3 docs/results/probes/h100-b16-final-norm/profile-plain/profile_spans.py --shape qwen2-vl-2b --weights w4a16-h8 --cache /tmp/cache --batch 16 --steps 32 --out $OUT/profile-w4a16-h8-b16-plain.json > $OUT/profile.log 2>&1
echo "profile rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt $OUT/attention.log
python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/profile-w4a16-h8-b16-plain.json"))
t = d["decode_timeline"]
print({k: t.get(k) for k in ("wall_us_a_token", "busy_us_a_token", "gap_us_a_token", "gap_median_us")})
for r in t["by_kernel"][:12]: print("   ", r)
print(d["decode_kernels"].get("dependent_launch"), d["decode_kernels"].get("step"))
PY
python3 - <<'PY'
import json, os, collections
d = json.load(open(f"{os.environ['OUT']}/places.json")); p = d["places"]
print("steps", d["steps"], "kernels a step", d["kernels_a_step"])
for r in p[:12]: print("  ", r)
kinds = collections.defaultdict(list)
# a layer: the five kernels from each staged q|k|v onwards
for j, r in enumerate(p): kinds[r["name"]].append(r["us"])
for k, v in kinds.items(): print(k, len(v), round(sum(v), 1))
PY
