#!/usr/bin/env bash
# H200: 4-bit batch 1, staged products among the step's tiles against without, in turns (2 rounds).
# Other cards (or MODE=matrix): the batch-1 matrix bf16, W8A16, W4A16 in one run.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); cache: $(ls /tmp/cache 2>/dev/null | tr '\n' ' ')" >> $OUT/gpu.txt
MODE=${MODE:-auto}
if [ "$MODE" = auto ]; then grep -q H200 $OUT/gpu.txt && MODE=staged || MODE=matrix; fi
echo "mode $MODE" >> $OUT/gpu.txt
if [ "$MODE" = staged ]; then
  timeout $(left ${LIMIT:-585}) scripts/bench_trees.sh /tmp/b1 ${ROUNDS:-2} WORKTREE EDGEINFER_STAGED_PRODUCTS=1@WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/b1/compare.md $OUT/compare-b1.md 2>/dev/null; tar czf $OUT/b1.tgz -C /tmp/b1 --exclude ./trees . 2>/dev/null
else
  timeout $(left ${LIMIT:-585}) scripts/bench_trees.sh /tmp/m1 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights bf16,w8a16-h8,w4a16-h8 --kinds ours --repeats 3 --warmup 1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/m1/compare.md $OUT/compare-b1.md 2>/dev/null; tar czf $OUT/m1.tgz -C /tmp/m1 --exclude ./trees . 2>/dev/null
fi
cat $OUT/gpu.txt; grep -v "^$" $OUT/compare-b1.md 2>/dev/null | head -20
true
