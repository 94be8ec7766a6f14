#!/usr/bin/env bash
# 4-bit batch-1 decode on one GPU: 8c50879 (HEAD) against this checkout with the staged kernel's one-row path letting the next
# kernel launch only after its MMAs (exp/late's staged.py), and the same with every kernel's shared memory carveout at 100
# (exp/carve's launching.py, EDGEINFER_CARVEOUT=100, EDGEINFER_CARVEOUT_KERNELS=all). Rounds in turns, the second reversed,
# each run in its own process, until the time runs out; then every run side by side.
set -u
MAX=${MAX:-560}
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=/tmp/rec; mkdir -p $R
cp exp/late/edgeinfer/quant/staged.py edgeinfer/quant/staged.py
cp exp/carve/edgeinfer/quant/launching.py edgeinfer/quant/launching.py
git diff --stat > $R/diff.txt; git diff >> $R/diff.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
C=EDGEINFER_CARVEOUT=100@EDGEINFER_CARVEOUT_KERNELS=all@WORKTREE
ARGS="bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1"
for r in 1 2 3; do
  case $r in 2) order="$C WORKTREE HEAD";; *) order="HEAD WORKTREE $C";; esac
  for t in $order; do
    [ $(left $MAX) -gt 125 ] || break 2
    PYTHONPATH=/tmp/site timeout $(left $((MAX - 8))) scripts/bench_trees.sh /tmp/b/r$r 1 $t -- $ARGS >> $R/bench.log 2>&1
    echo "round $r $t rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
  done
done
PYTHONPATH=/tmp/site:$PWD python3 scripts/compare_bench_runs.py /tmp/b/r*/*-1/gpu-*.json > $R/compare.md 2>> $R/gpu.txt
for f in /tmp/b/r*/*-1/gpu-*.json; do python3 - "$f" <<'PY' >> $R/gpu.txt 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
for name, res in d["results"].items():
    k = (res.get("diagnostics") or {}).get("kernels") or {}
    p = k.get("products") or {}
    print(sys.argv[1].split("/")[3:5], name, {n: v.get("config") for n, v in p.items()}, {x: (k.get("step") or {}).get(x) for x in ("alone_us", "in_step_us")})
PY
done
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
cat /tmp/b/r*/trees.log > $R/trees.log 2>/dev/null
cd /tmp/b && tar czf $R/bench.tgz --exclude './r*/trees' . 2>/dev/null; cd - >/dev/null
tar czf $OUT/rec.tgz -C $R .; cat $R/gpu.txt; grep -v "^$" $R/compare.md | cut -c1-220 | head -24
