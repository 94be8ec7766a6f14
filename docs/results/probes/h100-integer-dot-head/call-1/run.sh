#!/usr/bin/env bash
# The int8 head's tiles and their integer-dot twins (probe), then the packed decoders against the dense ones on a
# GPU with the integer-dot tiles among the candidates; on an H200, the 4-bit batch-1 bench of this tree after.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p $OUT/head $OUT/dense
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
git status --short >> $OUT/gpu.txt
OUT=$OUT/head ROUNDS=${ROUNDS:-5} PYTHONPATH=/tmp/site:$PWD timeout ${MAXH:-170} python3 scripts/probe_integer_dot.py --head > $OUT/head/probe.log 2>&1
echo "head rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
PYTHONPATH=/tmp/site:$PWD timeout ${MAX1:-230} python3 -m pytest -q -s -rA tests/test_quant_packed.py -k "${K1:-against_dense or dense_tokens}" > $OUT/dense/tests.log 2>&1
echo "dense rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
if grep -q H200 $OUT/gpu.txt && [ $(left 560) -gt 150 ]; then
  mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
  SETTLE_S=20 PYTHONPATH=/tmp/site timeout $(left 580) scripts/bench_trees.sh /tmp/t 1 WORKTREE -- bench gpu --shape qwen2-vl-2b \
    --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/bench.log 2>&1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
  mkdir -p $OUT/bench; cp -r /tmp/t/* $OUT/bench/ 2>/dev/null
fi
cat $OUT/gpu.txt; grep -v Warn $OUT/head/probe.log | tail -4; grep -E "divergence|passed|failed|PASS|FAIL" $OUT/dense/tests.log | tail -12
