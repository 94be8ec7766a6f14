#!/usr/bin/env bash
# 8-bit codes on the staged kernel: its GPU tests (4-bit and 8-bit), then W8A16 batch 1 with the staged tiles among the
# candidates (WORKTREE) against the same tree with them left out (EDGEINFER_STAGED_PRODUCTS=0, the 8-bit products as before).
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_quant_staged.py -k "torch_s and 8" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
timeout $(left 585) scripts/bench_trees.sh /tmp/w8 1 EDGEINFER_STAGED_PRODUCTS=0@WORKTREE WORKTREE -- bench gpu --shape qwen2-vl-2b \
  --cache /tmp/cache --batch-sizes 1 --weights w8a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cp /tmp/w8/compare.md $OUT/compare-w8.md 2>/dev/null; cp /tmp/w8/trees.log $OUT/ 2>/dev/null
tar czf $OUT/w8.tgz -C /tmp/w8 --exclude ./trees . 2>/dev/null
cat $OUT/gpu.txt; tail -5 $OUT/tests.log; grep -v "^$" $OUT/compare-w8.md 2>/dev/null | head -30
