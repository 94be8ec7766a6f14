#!/usr/bin/env bash
# The staged kernel's fused tiles at 8 and 16 rows with more splits among them (SPLITS_A_TILE 5 instead of 3:
# 1, 2, 3, 4 and 6 for K = 1,536; 5, 7, 10, 14 and 35 for down's 8,960), every tile in turns in one process.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
timeout ${MAX:-400} python3 -c "
import runpy, sys
from edgeinfer.quant import staged
staged.SPLITS_A_TILE = 5
sys.argv = ['probe_staged_rows.py', '--fused', '--rows', '8,16', '--rounds', '3', '--out', '$OUT/splits.json']
runpy.run_path('scripts/probe_staged_rows.py', run_name='__main__')
" > $OUT/splits.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt
python3 - $OUT <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/splits.json"))
for name, byrows in d["products"].items():
    for rows, row in byrows.items():
        us = row["us"]
        print(name, rows, " ".join(f"{k.replace('staged ', '')}={v}" for k, v in sorted(us.items(), key=lambda kv: kv[1])[:7]))
PY
