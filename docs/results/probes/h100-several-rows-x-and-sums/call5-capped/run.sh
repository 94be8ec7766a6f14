#!/usr/bin/env bash
# gate|up at 16 rows: the x-shared variant (two chunks ahead) with its registers capped, against the tree before.
# cap_probe.py is this folder's; v3_staged.py beside it was edgeinfer/quant/staged.py of a860b20 with
# ../variant-x-shared-ahead.patch applied.
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name --format=csv,noheader; cat /proc/loadavg
timeout 90 python3 docs/results/probes/h100-several-rows-x-and-sums/call5-capped/cap_probe.py 2>&1 | tail -3
cp docs/results/probes/h100-several-rows-x-and-sums/call5-capped/cap_probe.py $OUT/ 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt; cat /proc/loadavg >> $OUT/gpu.txt
