#!/usr/bin/env bash
# Any GPU: the present code's batch 16 (and on an H100 batch 1), bf16 and 4-bit (HEAD alone, bench gpu's warm-up of at
# least 5 s). On an H200, while time is left: 4-bit batch-1 decode of this checkout with exp/late's staged.py and of HEAD, one
# run each; on any other GPU, while time is left, exp/probe_window.py once, warm (6 s window, no pause). top beside them.
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
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,12p; done > $R/top.txt 2>&1) & TOP=$!
window() { local n=$1 t=$2; shift 2
  env "$@" PYTHONPATH=/tmp/site:$PWD timeout $t python3 exp/probe_window.py /tmp/cache $R/window-$n.json > $R/window-$n.txt 2>&1; local rc=$?
  echo "window run $n ($*) rc $rc at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; }
BS=1,16; grep -q H200 $R/gpu.txt && BS=16  # an H200's batch 1 comes from the HEAD run below
PYTHONPATH=/tmp/site timeout $(left $((MAX - 170))) scripts/bench_trees.sh /tmp/t 1 HEAD -- bench gpu --shape qwen2-vl-2b \
  --cache /tmp/cache --batch-sizes $BS --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/b16.log 2>&1
echo "b1/b16 rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
cp /tmp/t/compare.md $R/b16-compare.md 2>/dev/null
if grep -q H200 $R/gpu.txt; then
  cp exp/late/edgeinfer/quant/staged.py edgeinfer/quant/staged.py
  git diff > $R/late.diff
  ARGS="bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1"
  for t in WORKTREE HEAD; do
    [ $(left $MAX) -gt 65 ] || break
    PYTHONPATH=/tmp/site timeout $(left $((MAX - 5))) scripts/bench_trees.sh /tmp/b 1 $t -- $ARGS >> $R/late.log 2>&1
    echo "late $t rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  done
  PYTHONPATH=/tmp/site:$PWD python3 scripts/compare_bench_runs.py /tmp/b/*-1/gpu-*.json > $R/late-compare.md 2>> $R/gpu.txt
else
  [ $(left $MAX) -gt 100 ] && PAUSE=0 WINDOW=6 window 1 $(( $(left $MAX) - 10 ))
fi
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
kill $TOP 2>/dev/null
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
tar czf $OUT/rec.tgz -C $R .; cat $R/gpu.txt | cut -c1-300
for f in $R/b16-compare.md $R/late-compare.md; do [ -f $f ] && grep -v "^$" $f | cut -c1-220 | head -30; done
for f in $R/window-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
for w in d["windows"]:
    rows = w["rows"]; k = "process_image" if "process_image" in rows[0] else "processor"
    slow = [r for r in rows if r[k] > 20]
    print(sys.argv[1][-13:], w["label"][:10], "n", len(rows), "med", round(st.median(r[k] for r in rows), 1), "slow", len(slow),
          "last slow t", slow[-1]["t"] if slow else None, "pin med", round(st.median(r["pin"] for r in rows), 2),
          "flt", sum(r["pgfault"] for r in rows), "load_s", round(d["load_s"], 1), d.get("sync_after_load_ms"), d.get("env_malloc"), d.get("threads_after_load"))
    for name, part in (("slow", slow), ("rest", [r for r in rows if r[k] <= 20])):
        if part and "run_us" in part[0]:
            others = {}
            for r in part:
                for p, t in r["other_processes"].items():
                    others[p] = others.get(p, 0) + t
            print("  ", name, len(part), "run_us med", st.median(r["run_us"] for r in part), "runq_wait_us med",
                  st.median(r["runq_wait_us"] for r in part), "involuntary", sum(r["involuntary"] for r in part),
                  "psi cpu/mem/io", [sum(r["psi_us"][i] for r in part) for i in range(3)],
                  "new threads", [t for r in part for t in r["new_threads"].values()][:4],
                  "others", sorted(others.items(), key=lambda kv: -kv[1])[:5])
PY
done
