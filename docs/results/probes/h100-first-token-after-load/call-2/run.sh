#!/usr/bin/env bash
# On an H200: the present code's batch 1 and 16, bf16 and 4-bit (HEAD alone); then exp/probe_window.py (what runs beside
# a request in the seconds after Engine.load) in its own process; then, while time is left, 4-bit batch-1 decode of HEAD
# and of this checkout with exp/late's staged.py, one run each. On any other GPU: exp/probe_window.py twice, each in its
# own process (the first builds the checkpoint and compiles: cold; the second finds both ready). top beside them.
set -u
MAX=${MAX:-585}
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=/tmp/rec; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files; $(uname -r); thp $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1); numa_balancing $(cat /proc/sys/kernel/numa_balancing 2>&1)" >> $R/gpu.txt
ls /sys/bus/virtio/drivers 2>/dev/null | tr '\n' ' ' >> $R/gpu.txt; echo >> $R/gpu.txt
(while sleep 5; do date +%T; top -bn1 -w 180 | sed -n 1,12p; done > $R/top.txt 2>&1) & TOP=$!
window() { PYTHONPATH=/tmp/site:$PWD timeout $2 python3 exp/probe_window.py /tmp/cache $R/window-$1.json > $R/window-$1.txt 2>&1
  echo "window run $1 rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; }
if grep -q H200 $R/gpu.txt; then
  PYTHONPATH=/tmp/site timeout $(left $((MAX - 240))) scripts/bench_trees.sh /tmp/t 1 HEAD -- bench gpu --shape qwen2-vl-2b \
    --cache /tmp/cache --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/b16.log 2>&1
  echo "b1/b16 rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  cp /tmp/t/compare.md $R/b16-compare.md 2>/dev/null
  window 1 $(left $((MAX - 150)))
  cp exp/late/edgeinfer/quant/staged.py edgeinfer/quant/staged.py
  git diff > $R/late.diff
  ARGS="bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1"
  for t in WORKTREE HEAD; do
    [ $(left $MAX) -gt 65 ] || break
    PYTHONPATH=/tmp/site timeout $(left $((MAX - 5))) scripts/bench_trees.sh /tmp/b 1 $t -- $ARGS >> $R/late.log 2>&1
    echo "late $t rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  done
  PYTHONPATH=/tmp/site:$PWD python3 scripts/compare_bench_runs.py /tmp/b/*-1/gpu-*.json > $R/late-compare.md 2>> $R/gpu.txt
  for f in /tmp/t/*-1/gpu-*.json /tmp/b/*-1/gpu-*.json; do python3 - "$f" <<'PY' >> $R/gpu.txt 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
for name, res in d["results"].items():
    k = (res.get("diagnostics") or {}).get("kernels") or {}
    p = k.get("products") or {}
    print(sys.argv[1].split("/")[2:5], name, {n: v.get("config") for n, v in p.items()}, {x: (k.get("step") or {}).get(x) for x in ("alone_us", "in_step_us")})
PY
  done
  cat /tmp/t/trees.log /tmp/b/trees.log > $R/trees.log 2>/dev/null
  tar czf $R/bench.tgz --exclude 'tmp/t/trees' --exclude 'tmp/b/trees' -C / tmp/t tmp/b 2>/dev/null
else
  window 1 200; window 2 $(left $((MAX - 5)))
fi
kill $TOP 2>/dev/null
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
tar czf $OUT/rec.tgz -C $R .; cat $R/gpu.txt | cut -c1-300
for f in $R/b16-compare.md $R/late-compare.md; do [ -f $f ] && grep -v "^$" $f | cut -c1-220 | head -30; done
for i in 1 2; do grep -v "^ *[0-9]* root" $R/window-$i.txt 2>/dev/null | cut -c1-300 | head -40; done
