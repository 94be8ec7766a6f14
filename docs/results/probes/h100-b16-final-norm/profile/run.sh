#!/usr/bin/env bash
# Call 2: where the batch-16 step goes, 4-bit and bf16, the tree before this change (9322e94).
# Where the batch-16 step goes on this GPU: 4-bit and bf16 profiles (present code).
set -u
T0=$(date +%s)
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
for w in w4a16-h8 bf16; do
  timeout $(( 560 - ($(date +%s) - T0) )) python3 scripts/profile_gpu.py --shape qwen2-vl-2b --weights $w --cache /tmp/cache --batch 16 --steps 32 --out $OUT/profile-$w-b16.json > $OUT/profile-$w.log 2>&1
  echo "$w rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
done
cat $OUT/gpu.txt
python3 - <<'PY'
import json, os
for w in ("w4a16-h8", "bf16"):
    try: d = json.load(open(f"{os.environ['OUT']}/profile-{w}-b16.json"))
    except Exception as e: print(w, e); continue
    t = d.get("decode_timeline", {})
    print(w, "step wall ms", d.get("decode_step_wall_ms"), {k: t.get(k) for k in ("wall_us_a_token", "busy_us_a_token", "gap_us_a_token", "gaps_over_5us", "gap_median_us")})
    for r in t.get("by_kernel", [])[:14]: print("   ", r)
PY
