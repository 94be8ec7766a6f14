#!/usr/bin/env bash
# The step's ends on a GPU: their tests, the fused engine's tokens, then 4-bit batch-1 decode with the
# ends' kernels off and on (same tree, EDGEINFER_STEP_ENDS), in turns.  carry [".whl","exp/dev32.sh"]
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg)" >> $OUT/gpu.txt
timeout 60 python3 -m pytest -q -rs -p no:cacheprovider tests/test_step_ends.py > $OUT/tests-ends.log 2>&1
echo "step-ends tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
timeout 110 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "batch_one_fused" > $OUT/tests-gpu.log 2>&1
echo "fused engine tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
echo "load before b1: $(cat /proc/loadavg)" >> $OUT/gpu.txt
timeout $(left 585) scripts/bench_trees.sh /tmp/trees 2 EDGEINFER_STEP_ENDS=0@WORKTREE WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1
echo "b1 bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cp /tmp/trees/compare.md $OUT/compare-b1.md 2>/dev/null; tar czf $OUT/b1.tgz -C /tmp/trees --exclude ./trees . 2>/dev/null
cat $OUT/gpu.txt; for f in $OUT/compare-*.md; do grep -v "^$" $f | head -14; done; for f in $OUT/tests-*.log; do tail -n 6 $f; done
