#!/usr/bin/env bash
# 8-bit layers with a scale a row on the integer-dot tiles (probe), then 4-bit batch-1 decode of a28f30f against
# HEAD (the int8 head's integer-dot tiles), in turns.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p $OUT/row $OUT/bench
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $OUT/bench/top.txt 2>&1) & TOP=$!
SETTLE_S=${SETTLE_S:-30} PYTHONPATH=/tmp/site timeout $(left ${BMAX:-400}) scripts/bench_trees.sh /tmp/t ${ROUNDS:-1} ${TREES:-a28f30f HEAD} -- bench gpu --shape qwen2-vl-2b \
  --cache /tmp/cache --batch-sizes 1 --weights ${W:-w4a16-h8} --kinds ours --repeats 3 --warmup 1 > $OUT/bench/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
kill $TOP 2>/dev/null
cp /tmp/t/compare.md /tmp/t/trees.log $OUT/bench/ 2>/dev/null; for d in /tmp/t/*-[0-9]*/; do t=$(basename $d); mkdir -p $OUT/bench/$t; cp $d/* $OUT/bench/$t/; done 2>/dev/null
for f in $OUT/bench/*/gpu-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
k = next(iter(d["results"].values()))["diagnostics"]["kernels"]
print(sys.argv[1].split("/")[-2], {n: {b: round(v["decode_in_call_tok_s"]["median"], 1) for b, v in s.items()} for n, s in d["summary"].items()},
      "step", k["step"]["in_step_us"], "head", k["products"]["lm_head"]["config"], k["products"]["lm_head"]["us"],
      "quiet", d["quiet"]["publishable"], d["quiet"]["worst_others_load"])
PY
done > $OUT/bench/summary.txt 2>&1
if [ "${PROBE:-1}" = 1 ]; then
OUT=$OUT/row BITS=8 GROUP=row ROUNDS=2 PYTHONPATH=/tmp/site:$PWD timeout $(left 585) python3 scripts/probe_integer_dot.py > $OUT/row/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
fi
cat $OUT/gpu.txt; grep -v Warn $OUT/row/probe.log | tail -6; cat $OUT/bench/summary.txt; tail -3 $OUT/bench/bench.log
