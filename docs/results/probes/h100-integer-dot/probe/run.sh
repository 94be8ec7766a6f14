#!/usr/bin/env bash
# The integer-dot twins of the batch-1 packed tiles beside the float ones (probe), then their GPU tests.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
OUT=$OUT ROUNDS=${ROUNDS:-3} timeout ${MAX:-380} python3 scripts/probe_integer_dot.py > $OUT/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
timeout $(( 560 - ($(date +%s) - T0) )) python3 -m pytest -q -x tests/test_quant_packed.py -k "integer_dot or bfloat16_row or split_product" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -3 $OUT/tests.log; cat $OUT/probe.log | grep -v Warn | tail -20
