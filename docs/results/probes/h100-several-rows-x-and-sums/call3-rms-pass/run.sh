#!/usr/bin/env bash
set -u
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg)" >> $OUT/gpu.txt
timeout 200 python3 docs/results/probes/h100-several-rows-x-and-sums/call3-rms-pass/probe_rms_pass.py > $OUT/kc0.log 2>&1; echo "rc $?" >> $OUT/gpu.txt
cat $OUT/gpu.txt $OUT/kc0.log | tail -20
