#!/usr/bin/env bash
# A/B of the few-row descent: 4-bit at batch 16 with EDGEINFER_ROWS_IN_STEP=1 and without, taking turns,
# then bf16 at batch 16 for the ratio, then the fused-rows GPU test if time is left. One file back: $OUT/rec.tgz.
set -u
MAX=${MAX:-540}; RESERVE=${AB_RESERVE:-150}
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=${R:-/tmp/rec}; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
git status --short >> $R/gpu.txt
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $R/top.txt 2>&1) & TOP=$!
save() { tar czf $OUT/rec.tgz -C $R . 2>/dev/null; }
summ() { for f in $1/*/gpu-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].split("/")[-2])
for name, s in d["summary"].items():
    print(" ", name, {b: [round(x, 1) for x in v["decode_in_call_tok_s"]["runs"]] if "runs" in v["decode_in_call_tok_s"] else round(v["decode_in_call_tok_s"]["median"], 1) for b, v in s.items()},
          {b: round(v["decode_in_call_tok_s"]["median"], 1) for b, v in s.items()})
print("  quiet", d["quiet"]["publishable"], d["quiet"]["worst_others_load"])
rs = d.get("diagnostics", {})
def find(o, k, path=""):
    if isinstance(o, dict):
        for kk, vv in o.items():
            if kk == k: print("  ", path + "/" + kk, json.dumps(vv)[:900])
            else: find(vv, k, path + "/" + kk)
    elif isinstance(o, list):
        for i, vv in enumerate(o): find(vv, k, path + f"[{i}]")
find(d, "rows_step")
PY
done; }
TREES=${TREES:-"EDGEINFER_ROWS_IN_STEP=1@WORKTREE WORKTREE"}
PYTHONPATH=/tmp/site timeout $(left $((MAX - RESERVE))) scripts/bench_trees.sh /tmp/ab ${ROUNDS:-1} $TREES -- bench gpu --shape qwen2-vl-2b \
  --cache /tmp/cache --batch-sizes ${BS:-16} --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/ab.log 2>&1
echo "ab rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
mkdir -p $R/ab; cp -r /tmp/ab/compare.md /tmp/ab/trees.log /tmp/ab/*-1 /tmp/ab/*-2 /tmp/ab/*.log $R/ab/ 2>/dev/null
summ /tmp/ab > $R/ab-summary.txt 2>&1; save; cat $R/ab-summary.txt | cut -c1-1200
if [ $(left $MAX) -gt 110 ]; then
  PYTHONPATH=/tmp/site timeout $(left $((MAX - 40))) scripts/bench_trees.sh /tmp/bf 1 WORKTREE -- bench gpu --shape qwen2-vl-2b \
    --cache /tmp/cache --batch-sizes ${BS:-16} --weights bf16 --kinds ours --repeats 3 --warmup 1 > $R/bf.log 2>&1
  echo "bf16 rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  mkdir -p $R/bf; cp -r /tmp/bf/compare.md /tmp/bf/trees.log /tmp/bf/*-1 $R/bf/ 2>/dev/null
  summ /tmp/bf > $R/bf-summary.txt 2>&1; save; cat $R/bf-summary.txt | cut -c1-600
fi
if [ $(left $MAX) -gt 60 ]; then
  PYTHONPATH=/tmp/site:. timeout $(left $((MAX - 10))) python3 -m pytest -q -p no:cacheprovider tests/test_quant_staged.py -k "rows" > $R/test.log 2>&1
  echo "test rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt; tail -3 $R/test.log
fi
kill $TOP 2>/dev/null; save; cut -c1-300 $R/gpu.txt; tail -4 $R/ab.log
