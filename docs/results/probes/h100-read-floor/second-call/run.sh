#!/usr/bin/env bash
# The read-only floor of the batch-1 4-bit products beside the products, with arithmetic added to the reads (every card). On an H200 first: the targets benchmark.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
if grep -q H200 $OUT/gpu.txt; then
  timeout $(left 330) scripts/bench_trees.sh /tmp/t0 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache \
    --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench-targets.log 2>&1
  echo "targets bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/t0/compare.md $OUT/compare-targets.md 2>/dev/null
  tar czf $OUT/t0.tgz -C /tmp/t0 --exclude ./trees . 2>/dev/null
fi
OUT=$OUT ROUNDS=5 timeout $(left 585) python3 scripts/probe_read_floor.py > $OUT/run.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -12 $OUT/run.log; grep -v "^$" $OUT/compare-targets.md 2>/dev/null | head -30
