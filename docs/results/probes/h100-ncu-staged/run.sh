#!/usr/bin/env bash
# Nsight Compute on the batch-1 products, the staged kernel's fastest tiles among them. On an H200 first: the targets' benchmark.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files; ncu: $(which ncu) $(ncu --version 2>&1 | tail -1)" >> $OUT/gpu.txt
if grep -q H200 $OUT/gpu.txt; then
  timeout $(left 400) scripts/bench_trees.sh /tmp/t 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache \
    --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/t/compare.md $OUT/compare.md 2>/dev/null; cp /tmp/t/trees.log $OUT/ 2>/dev/null
  tar czf $OUT/t.tgz -C /tmp/t --exclude ./trees . 2>/dev/null
fi
timeout $(left 560) ncu --clock-control none --profile-from-start off --set full -o /tmp/products \
  python3 scripts/probe_ncu_products.py > $OUT/ncu.log 2>&1
echo "ncu rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
ncu --import /tmp/products.ncu-rep --page details --csv > $OUT/details.csv 2>>$OUT/ncu.log
ncu --import /tmp/products.ncu-rep --page raw --csv > $OUT/raw.csv 2>>$OUT/ncu.log
gzip -k $OUT/raw.csv 2>/dev/null && rm -f $OUT/raw.csv
cat $OUT/gpu.txt; tail -20 $OUT/ncu.log; ls -la $OUT
