#!/usr/bin/env bash
# Warm H200 after dev87: the batch-16 step profiled, bf16 then 4-bit, each in its own process. One file back.
set -u
T0=$(date +%s)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 PATH=/tmp/bin:$PATH
R=/tmp/rec3; mkdir -p $R
echo "load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD)" > $R/gpu.txt
for w in bf16 w4a16-h8; do
  PYTHONPATH=/tmp/site:. timeout 200 python3 scripts/profile_gpu.py --shape qwen2-vl-2b --weights $w --cache /tmp/cache --batch 16 --steps 32 --out $R/profile-b16-$w.json > $R/profile-b16-$w.log 2>&1
  echo "$w rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  tar czf $OUT/rec.tgz -C $R .
done
cat $R/gpu.txt; for w in bf16 w4a16-h8; do tail -3 $R/profile-b16-$w.log; done
