#!/usr/bin/env bash
# exp/probe_window.py (bf16 engine), each run in its own process: cold once on this checkout (builds the checkpoint,
# compiles), then warm in turns over three trees: 59d7187 (torch.compile's workers started at the first compile, kept),
# this checkout (started as the load begins, let go once it ends) and nice (this checkout with exp/nice's
# compile_workers.py: the workers' process at nice 19 as it starts). top beside them; every file to $OUT as written.
set -u
MAX=${MAX:-570}
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
R=/tmp/rec; mkdir -p $R /tmp/head /tmp/nice
git archive 59d7187 | tar x -C /tmp/head
cp -r edgeinfer /tmp/nice/ && cp exp/nice/compile_workers.py /tmp/nice/edgeinfer/backends/torch/compile_workers.py
diff -u edgeinfer/backends/torch/compile_workers.py /tmp/nice/edgeinfer/backends/torch/compile_workers.py > $R/nice.diff
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
git status --short >> $R/gpu.txt
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $R/top.txt 2>&1) & TOP=$!
save() { tar czf $OUT/rec.tgz -C $R . 2>/dev/null; }
window() { local n=$1 tree=$2 t=$3; shift 3
  env "$@" PYTHONPATH=/tmp/site:$tree timeout $t python3 exp/probe_window.py /tmp/cache $R/window-$n.json > $R/window-$n.txt 2>&1; local rc=$?
  echo "window run $n ($tree $*) rc $rc at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; save; }
window 1 $PWD 240 WINDOW=2 PAUSE=0
n=2
for tree in ${ORDER:-/tmp/head $PWD /tmp/nice /tmp/nice /tmp/head $PWD $PWD /tmp/nice /tmp/head}; do
  [ $(left $MAX) -gt 55 ] || break
  window $n $tree 60 WINDOW=6 PAUSE=0; n=$((n + 1))
done
kill $TOP 2>/dev/null
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
for f in $R/window-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
w = d["windows"][1]; rows = w["rows"]
slow = [r for r in rows if r["process_image"] > 20]
after = lambda k: d.get(k) or {}
print(sys.argv[1][-13:], "load_s", round(d["load_s"], 1), {k: round(v, 2) for k, v in (d.get("load_timings") or {}).items()},
      "n", len(rows), "med", round(st.median(r["process_image"] for r in rows), 1),
      "slow", len(slow), "last slow t", slow[-1]["t"] if slow else None, "pin med", round(st.median(r["pin"] for r in rows), 2),
      "kids after load", len(after("descendants_after_load").get("processes", [])), after("descendants_after_load").get("pss_kib", 0) // 1024, "MiB",
      "at end", len(after("descendants_at_end").get("processes", [])), after("descendants_at_end").get("pss_kib", 0) // 1024, "MiB",
      "runq wait ms", round(sum(r["runq_wait_us"] for r in rows) / 1e3, 1))
PY
done > $R/windows-summary.txt 2>&1
save; cat $R/windows-summary.txt | cut -c1-400; cut -c1-300 $R/gpu.txt
