#!/usr/bin/env bash
# The integer-dot tiles' GPU tests, beside the float tiles' exactness and split tests.
set -u
T0=$(date +%s)
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
PYTHONPATH=/tmp/site:$PWD timeout ${MAX:-150} python3 -m pytest -q -rs tests/test_quant_packed.py -k "integer_dot or rounded_once or split_product" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -4 $OUT/tests.log
