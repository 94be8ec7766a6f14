#!/usr/bin/env bash
# On an H200: the #18 batch-16 ratio (bf16 and 4-bit in one run), then 4-bit batch 1 with the step's ends.
# Elsewhere: the 4-bit batch-1 profile with the step's ends, then the batch-16 ratio.  carry [".whl","exp/dev33.sh"]
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg)" >> $OUT/gpu.txt
b16() {
  echo "load before b16: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  timeout $1 scripts/bench_trees.sh /tmp/b16 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1
  echo "b16 bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/b16/compare.md $OUT/compare-b16.md 2>/dev/null; tar czf $OUT/b16.tgz -C /tmp/b16 --exclude ./trees . 2>/dev/null
}
if grep -q H200 $OUT/gpu.txt; then
  b16 $(left 420)
  echo "load before b1: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  timeout $(left 590) scripts/bench_trees.sh /tmp/b1 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1
  echo "b1 bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/b1/compare.md $OUT/compare-b1.md 2>/dev/null; tar czf $OUT/b1.tgz -C /tmp/b1 --exclude ./trees . 2>/dev/null
else
  echo "load before profile: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  timeout 200 python3 scripts/profile_gpu.py --shape qwen2-vl-2b --weights w4a16-h8 --cache /tmp/cache --batch 1 --out $OUT/profile-w4-b1.json > $OUT/profile.log 2>&1
  echo "profile rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
  b16 $(left 590)
fi
cat $OUT/gpu.txt; for f in $OUT/compare-*.md; do grep -v "^$" $f | head -14; done; tail -n 3 $OUT/profile.log 2>/dev/null
