#!/usr/bin/env bash
# Call 4: the attention alone at 16 and 1 rows by where the pool's blocks lie (pool_probe.py). It stopped
# after the first two pools at 16 rows: the third could not be allocated beside the second's (the probe kept a
# reference to it), so only those two lines came back, in pool-probe.log.
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader; cat /proc/loadavg
timeout 200 python3 docs/results/probes/h100-b16-final-norm/attention/pool_probe.py 2>&1 | tail -14
