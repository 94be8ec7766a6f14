#!/usr/bin/env bash
# The several-rows staged kernel with x straight into the B operand's layout: GPU tests, then every fused
# tile at 8 and 16 rows, the tree before (HEAD) and this checkout, each in its own process, in turns.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
git diff --stat >> $OUT/gpu.txt
rm -rf /tmp/base && mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
PYTHONPATH=/tmp/site:$PWD timeout $(left 260) python3 -m pytest -q -p no:cacheprovider -x tests/test_quant_staged.py \
  -k "several_rows" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
tail -3 $OUT/tests.log >> $OUT/gpu.txt
for r in 1 2; do
  for t in base new; do
    [ $(left ${MAX:-585}) -lt 40 ] && break
    root=$PWD; [ $t = base ] && root=/tmp/base
    (cd $root && PYTHONPATH=/tmp/site:$root timeout $(left ${MAX:-585}) python3 scripts/probe_staged_rows.py --fused \
       --rows 8,16 --rounds 3 --out $OUT/rows-$t-$r.json > $OUT/rows-$t-$r.log 2>&1)
    echo "$t round $r rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
  done
done
cat $OUT/gpu.txt; grep -v "Warning\|warn" $OUT/tests.log | tail -15
for f in $OUT/rows-*.log; do echo "== $f"; grep -E "^(qkv|o|gate_up|down) " $f; done
python3 - $OUT <<'PY'
import json, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/rows-*.json")):
    d = json.load(open(f))
    for name, byrows in d["products"].items():
        for rows, row in byrows.items():
            us = row["us"]
            print(f.split("/")[-1], name, rows, " ".join(f"{k.replace('staged ', '')}={v}" for k, v in sorted(us.items(), key=lambda kv: kv[1])[:4]))
PY
