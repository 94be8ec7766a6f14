#!/usr/bin/env bash
# exp/probe_window.py (bf16 engine), each run in its own process: cold on this checkout (builds the checkpoint, compiles;
# torch.compile's workers started as the load begins and let go once it ends), then warm in turns: 59d7187
# (the workers started at the first compile and kept), this checkout, 59d7187, this checkout. top beside them.
set -u
T0=$(date +%s)
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
R=/tmp/rec; mkdir -p $R /tmp/head
git archive 59d7187 | tar x -C /tmp/head  # the code before the change
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
git diff 59d7187 -- edgeinfer tests > $R/change.diff; git status --short >> $R/gpu.txt
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $R/top.txt 2>&1) & TOP=$!
window() { local n=$1 tree=$2 t=$3; shift 3
  env "$@" PYTHONPATH=/tmp/site:$tree timeout $t python3 exp/probe_window.py /tmp/cache $R/window-$n.json > $R/window-$n.txt 2>&1; local rc=$?
  echo "window run $n ($tree $*) rc $rc at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  cp $R/window-$n.* $R/gpu.txt $OUT/ 2>/dev/null; }  # each run's files come back even if a later one runs out of time
window 1 $PWD 240 WINDOW=2 PAUSE=0
n=2; for tree in /tmp/head $PWD /tmp/head $PWD; do
  [ $(( ${MAX:-570} - ($(date +%s) - T0) )) -gt 45 ] || break
  window $n $tree 60 WINDOW=6 PAUSE=0; n=$((n + 1))
done
kill $TOP 2>/dev/null
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
tar czf $OUT/rec.tgz -C $R .; cut -c1-300 $R/gpu.txt
for f in $R/window-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
w = d["windows"][1]; rows = w["rows"]
slow = [r for r in rows if r["process_image"] > 20]
after = lambda k: d.get(k) or {}
print(sys.argv[1][-13:], "load_s", round(d["load_s"], 1), "timings", {k: round(v, 1) for k, v in (d.get("load_timings") or {}).items()},
      "n", len(rows), "med", round(st.median(r["process_image"] for r in rows), 1), "slow", len(slow), "last slow t", slow[-1]["t"] if slow else None,
      "pin med", round(st.median(r["pin"] for r in rows), 2),
      "kids after load", len(after("descendants_after_load").get("processes", [])), after("descendants_after_load").get("pss_kib", 0) // 1024, "MiB",
      "at end", len(after("descendants_at_end").get("processes", [])), after("descendants_at_end").get("pss_kib", 0) // 1024, "MiB",
      "runq wait ms", round(sum(r["runq_wait_us"] for r in rows) / 1e3, 1),
      "others", sorted({p: sum(r["other_processes"].get(p, 0) for r in rows) for r in rows for p in r["other_processes"]}.items(), key=lambda kv: -kv[1])[:2])
PY
done
