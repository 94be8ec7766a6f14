#!/usr/bin/env bash
# bench gpu on this checkout (batch 1 and 16, bf16 and 4-bit, each format in its own process; each call now records what it
# compiled, captured and tuned), and exp/probe_window.py (bf16 engine) in turns: 59d7187 (torch.compile's workers started at
# the first compile and kept) against this checkout (started as the load begins, let go once it ends). On an H200 the bench
# first, then the windows warm; on any other GPU the windows first (the first run cold, on this checkout), then the bench
# at batch 16 while time is left. top beside them. Every file goes to $OUT as soon as it is written.
set -u
MAX=${MAX:-585}
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=/tmp/rec; mkdir -p $R /tmp/head
git archive 59d7187 | tar x -C /tmp/head
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
git status --short >> $R/gpu.txt; git diff 59d7187 HEAD -- edgeinfer/backends/torch/compile_workers.py edgeinfer/engine/engine.py > $R/change.diff
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $R/top.txt 2>&1) & TOP=$!
save() { cp -r $R/. $OUT/ 2>/dev/null; }
window() { local n=$1 tree=$2 t=$3; shift 3
  env "$@" PYTHONPATH=/tmp/site:$tree timeout $t python3 exp/probe_window.py /tmp/cache $R/window-$n.json > $R/window-$n.txt 2>&1; local rc=$?
  echo "window run $n ($tree $*) rc $rc at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt; save; }
bench() { local bs=$1
  PYTHONPATH=/tmp/site timeout $(left $((MAX - 5))) scripts/bench_trees.sh /tmp/t 1 HEAD -- bench gpu --shape qwen2-vl-2b \
    --cache /tmp/cache --batch-sizes $bs --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
  echo "bench b$bs rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  mkdir -p $R/bench; cp /tmp/t/compare.md /tmp/t/trees.log /tmp/t/HEAD-1/* $R/bench/ 2>/dev/null; save; }
windows() {  # warm runs in turns while time is left
  local n=$1
  for tree in /tmp/head $PWD /tmp/head $PWD /tmp/head $PWD; do
    [ $(left $MAX) -gt ${2:-75} ] || break
    window $n $tree 60 WINDOW=6 PAUSE=0; n=$((n + 1))
  done; }
if grep -q H200 $R/gpu.txt; then
  bench 1,16
  windows 1
else
  window 1 $PWD 240 WINDOW=2 PAUSE=0
  windows 2
  [ $(left $MAX) -gt 250 ] && bench 16
fi
kill $TOP 2>/dev/null
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
for f in $R/window-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
w = d["windows"][1]; rows = w["rows"]
slow = [r for r in rows if r["process_image"] > 20]
after = lambda k: d.get(k) or {}
print(sys.argv[1][-13:], "load_s", round(d["load_s"], 1), "n", len(rows), "med", round(st.median(r["process_image"] for r in rows), 1),
      "slow", len(slow), "last slow t", slow[-1]["t"] if slow else None, "pin med", round(st.median(r["pin"] for r in rows), 2),
      "kids after load", len(after("descendants_after_load").get("processes", [])), after("descendants_after_load").get("pss_kib", 0) // 1024, "MiB",
      "at end", len(after("descendants_at_end").get("processes", [])), after("descendants_at_end").get("pss_kib", 0) // 1024, "MiB",
      "runq wait ms", round(sum(r["runq_wait_us"] for r in rows) / 1e3, 1))
PY
done > $R/windows-summary.txt 2>&1
for f in $R/bench/gpu-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, runs in d["runs"].items():
    for r in runs:
        p = r.get("parts") or {}
        print(name, r["label"], round(r["full_s"], 2), round(r.get("full_first_s") or 0, 2), (p.get("full") or {}).get("during"), (p.get("one") or {}).get("during"))
for name, s in d["summary"].items():
    print(name, {b: round(v["decode_in_call_tok_s"]["median"], 1) for b, v in s.items()})
print("rooflines", {n: {b: round(v["fraction"], 3) for b, v in r.items()} for n, r in d["rooflines"].items()}, "quiet", d["quiet"]["publishable"], d["quiet"]["worst_others_load"])
PY
done > $R/bench-summary.txt 2>&1
save; cat $R/windows-summary.txt $R/bench-summary.txt | cut -c1-400; cut -c1-300 $R/gpu.txt
