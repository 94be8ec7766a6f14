#!/usr/bin/env bash
# scripts/probe_x_prefetch.py on this checkout, then the integer-dot GPU tests with the x prefetch on. top beside it.
set -u
T0=$(date +%s)
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
git status --short >> $R/gpu.txt
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $R/top.txt 2>&1) & TOP=$!
OUT=$R ROUNDS=${ROUNDS:-7} PYTHONPATH=/tmp/site:$PWD timeout ${P:-150} python3 scripts/probe_x_prefetch.py > $R/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
kill $TOP 2>/dev/null
EDGEINFER_X_PREFETCH=1 PYTHONPATH=/tmp/site:$PWD timeout ${T:-60} python3 -m pytest -q tests/test_quant_packed.py -k integer_dot -p no:cacheprovider > $R/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
cat $R/probe.log | cut -c1-400; tail -2 $R/tests.log; cat $R/gpu.txt
