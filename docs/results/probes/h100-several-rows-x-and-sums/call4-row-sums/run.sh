#!/usr/bin/env bash
# The rows' sums of squares handed from the residual's product to the next norm (EDGEINFER_ROW_SUMS):
# GPU tests, then batch 16 bf16 against 4-bit in one run, then the probe alone.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
timeout ${TESTS_S:-130} python3 -m pytest -q -x -p no:cacheprovider -rs tests/test_quant_staged.py \
  -k "(sums_the_residual and dtype0) or batched_decode_on_the_fused_rows" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
timeout $(left ${BENCH_END:-520}) scripts/bench_trees.sh /tmp/b16 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache \
  --batch-sizes 16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
cp /tmp/b16/compare.md $OUT/compare-b16.md 2>/dev/null; tar czf $OUT/b16.tgz -C /tmp/b16 --exclude ./trees . 2>/dev/null
timeout $(left 590) python3 scripts/probe_staged_rows.py --fused --rows 16 --rounds 3 --shapes qkv,gate_up \
  --out $OUT/alone-sums.json > $OUT/alone-sums.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -4 $OUT/tests.log; grep -v "^$" $OUT/compare-b16.md 2>/dev/null | head -24; grep -h "best_with\|^[a-z_]* 16" $OUT/alone-sums.log | head
python3 - <<'PY' 2>/dev/null
import json, os
d = json.load(open(os.environ["OUT"] + "/alone-sums.json"))
for k, v in d["products"].items():
    print(k, v["16"].get("best_staged"), v["16"].get("best_with_sums_in"))
PY
true
