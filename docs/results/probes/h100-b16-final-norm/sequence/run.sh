#!/usr/bin/env bash
# Call 5: the attention between the products it sits between at 16 rows (seq_probe.py).
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; cat /proc/loadavg | tee -a $OUT/gpu.txt
git rev-parse --short HEAD >> $OUT/gpu.txt; cp docs/results/probes/h100-b16-final-norm/sequence/seq_probe.py $OUT/
timeout 240 python3 docs/results/probes/h100-b16-final-norm/sequence/seq_probe.py 2>&1 | tail -14; cat /proc/loadavg | tee -a $OUT/gpu.txt
