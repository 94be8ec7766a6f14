#!/usr/bin/env bash
# The staged kernel with each chunk's Σx summed in float32 (one MMA a word, not two; HEAD): its GPU tests, the same tests on a mutated copy (they must fail), then the step. On an H200: the targets benchmark of HEAD; else HEAD against HEAD~1 (the kernel before), 4-bit, batches 1 and 16.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
timeout $(left 200) python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_quant_staged.py > $OUT/tests.log 2>&1
echo "staged GPU tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
(cd exp/mut && PYTHONPATH=/tmp/site:$PWD timeout $(left 250) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_quant_staged.py -k "step_s_check and bfloat16 and (plain or residual)") > $OUT/mutation.log 2>&1
echo "mutated copy's tests rc $? (non-zero: caught) at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
if grep -q H200 $OUT/gpu.txt; then
  timeout $(left 585) scripts/bench_trees.sh /tmp/t0 1 HEAD -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache \
    --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
else
  timeout $(left 585) scripts/bench_trees.sh /tmp/t0 1 HEAD~1 HEAD -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache \
    --batch-sizes 1,16 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
fi
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cp /tmp/t0/compare.md $OUT/compare.md 2>/dev/null
tar czf $OUT/t0.tgz -C /tmp/t0 --exclude ./trees . 2>/dev/null
cat $OUT/gpu.txt; tail -5 $OUT/tests.log; tail -3 $OUT/mutation.log; grep -v "^$" $OUT/compare.md 2>/dev/null | head -40
