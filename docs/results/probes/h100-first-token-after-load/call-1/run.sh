#!/usr/bin/env bash
# On an H200: the present code's batch 1 and 16, bf16 and 4-bit (HEAD alone), then 4-bit batch-1 decode of HEAD against
# this checkout with the staged kernel's one-row path letting the next kernel launch only after its MMAs (exp/late's
# staged.py), two rounds in turns, the second reversed, each run in its own process. On any other GPU: the submit probe
# (exp/probe_submit.py) in its own process, a 4-bit batch-1 bench of HEAD, then the probe twice more. top beside them.
set -u
MAX=${MAX:-585}
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=/tmp/rec; mkdir -p $R
ps_top() { echo "== $1 $(date +%T)" >> $R/ps.txt; ps -eo pid,ppid,etime,pcpu,rss,comm,args --sort=-pcpu | cut -c1-200 | head -12 >> $R/ps.txt; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
(while sleep 15; do date +%T; top -bn1 -w 180 | sed -n 1,16p; done > $R/top.txt 2>&1) & TOP=$!
if grep -q H200 $R/gpu.txt; then
  PYTHONPATH=/tmp/site timeout $(left $((MAX - 200))) scripts/bench_trees.sh /tmp/t 1 HEAD -- bench gpu --shape qwen2-vl-2b \
    --cache /tmp/cache --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/b16.log 2>&1
  echo "b1/b16 rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; ps_top after-b16
  cp /tmp/t/compare.md $R/b16-compare.md 2>/dev/null
  cp exp/late/edgeinfer/quant/staged.py edgeinfer/quant/staged.py
  git diff > $R/late.diff
  ARGS="bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1"
  for r in 1 2; do
    case $r in 2) order="WORKTREE HEAD";; *) order="HEAD WORKTREE";; esac
    for t in $order; do
      [ $(left $MAX) -gt 70 ] || break 2
      PYTHONPATH=/tmp/site timeout $(left $((MAX - 8))) scripts/bench_trees.sh /tmp/b/r$r 1 $t -- $ARGS >> $R/late.log 2>&1
      echo "late round $r $t rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; ps_top after-$r-$t
    done
  done
  PYTHONPATH=/tmp/site:$PWD python3 scripts/compare_bench_runs.py /tmp/b/r*/*-1/gpu-*.json > $R/late-compare.md 2>> $R/gpu.txt
  for f in /tmp/t/*-1/gpu-*.json /tmp/b/r*/*-1/gpu-*.json; do python3 - "$f" <<'PY' >> $R/gpu.txt 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
for name, res in d["results"].items():
    k = (res.get("diagnostics") or {}).get("kernels") or {}
    p = k.get("products") or {}
    print(sys.argv[1].split("/")[2:5], name, {n: v.get("config") for n, v in p.items()}, {x: (k.get("step") or {}).get(x) for x in ("alone_us", "in_step_us")})
PY
  done
  cat /tmp/t/trees.log /tmp/b/r*/trees.log > $R/trees.log 2>/dev/null
  tar czf $R/bench.tgz --exclude 'tmp/t/trees' --exclude 'tmp/b/r*/trees' -C / tmp/t tmp/b 2>/dev/null
else
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 exp/probe_submit.py /tmp/cache $R/submit-1.json run1 > $R/submit-1.txt 2>&1
  echo "submit run 1 rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; ps_top after-submit-1
  PYTHONPATH=/tmp/site timeout 200 scripts/bench_trees.sh /tmp/t 1 HEAD -- bench gpu --shape qwen2-vl-2b \
    --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 2 --warmup 1 > $R/b1.log 2>&1
  echo "bench b1 rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; ps_top after-bench
  for i in 2 3; do
    [ $(left $((MAX - 150))) -gt 45 ] || break
    PYTHONPATH=/tmp/site:$PWD timeout $(left $((MAX - 150))) python3 exp/probe_submit.py /tmp/cache $R/submit-$i.json run$i > $R/submit-$i.txt 2>&1
    echo "submit run $i rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; ps_top after-submit-$i
  done
  tar czf $R/bench.tgz --exclude 'tmp/t/trees' -C / tmp/t 2>/dev/null
fi
kill $TOP 2>/dev/null
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
tar czf $OUT/rec.tgz -C $R .; cat $R/gpu.txt | cut -c1-400
for f in $R/b16-compare.md $R/late-compare.md; do [ -f $f ] && grep -v "^$" $f | cut -c1-220 | head -30; done
for i in 1 2 3; do head -16 $R/submit-$i.txt 2>/dev/null | cut -c1-400; done
