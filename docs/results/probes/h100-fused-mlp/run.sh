#!/usr/bin/env bash
# Every card: the fused MLP probe. On an H200 also: batch 1 and 16, bf16, 8-bit and 4-bit, this tree (the targets' figures).
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
mkdir -p $OUT/fused-mlp
OUT=$OUT/fused-mlp ROUNDS=5 timeout $(left 300) python3 scripts/probe_fused_mlp.py > $OUT/fused-mlp/run.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
if grep -q H200 $OUT/gpu.txt; then
  timeout $(left 585) scripts/bench_trees.sh /tmp/t 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache \
    --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/t/compare.md $OUT/compare.md 2>/dev/null; cp /tmp/t/trees.log $OUT/ 2>/dev/null
  tar czf $OUT/t.tgz -C /tmp/t --exclude ./trees . 2>/dev/null
fi
cat $OUT/gpu.txt; tail -30 $OUT/fused-mlp/run.log; tail -3 $OUT/bench.log 2>/dev/null; grep -v "^$" $OUT/compare.md 2>/dev/null | head -20
