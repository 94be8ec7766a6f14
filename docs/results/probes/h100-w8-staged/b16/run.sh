#!/usr/bin/env bash
# 8-bit codes on the staged kernel at 2 to 16 rows: W8A16 batch 16 with the staged tiles among the few-row tuner's
# candidates (WORKTREE: the fused few-row layers where it takes them) against the same tree with them left out
# (EDGEINFER_STAGED_ROWS=0: 8-bit products as before), then the 8-bit GPU tests of several rows the last call did not reach.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
EDGEINFER_STAGED_ROWS=0 timeout 150 python3 scripts/probe_staged_rows.py --bits 8 --rows 16 --rounds 3 \
  --shapes qkv,o,gate_up,down,lm_head --out $OUT/probe-rows-w8.json > $OUT/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
timeout $(left 540) scripts/bench_trees.sh /tmp/w8 1 EDGEINFER_STAGED_ROWS=0@WORKTREE WORKTREE -- bench gpu --shape qwen2-vl-2b \
  --cache /tmp/cache --batch-sizes 16 --weights w8a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cp /tmp/w8/compare.md $OUT/compare-w8-b16.md 2>/dev/null; cp /tmp/w8/trees.log $OUT/ 2>/dev/null
tar czf $OUT/w8-b16.tgz -C /tmp/w8 --exclude ./trees . 2>/dev/null
timeout $(left 585) python3 -m pytest -q -p no:cacheprovider -rs tests/test_quant_staged.py -k "several_rows and torch_s and 8" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt; grep -v "^ \|^{\|^}" $OUT/probe.log | tail -8; tail -5 $OUT/tests.log; grep -v "^$" $OUT/compare-w8-b16.md 2>/dev/null | head -30
