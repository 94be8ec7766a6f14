#!/usr/bin/env bash
# W8A16 g128 (int8 head) batch-1 decode: the present tree against the same with the integer-dot tiles among 8-bit
# grouped weights' candidates (${PATCH:-exp/w8-groups.patch}), in turns; then the packed-against-dense GPU tests. One file back.
set -u
MAX=${MAX:-585}
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=/tmp/rec; mkdir -p $R
save() { tar czf $OUT/rec.tgz -C $R . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
git -c user.name=bench -c user.email=bench@localhost add -A >/dev/null 2>&1
git -c user.name=bench -c user.email=bench@localhost commit -qm "present tree" && BASE=$(git rev-parse --short HEAD)
git apply ${PATCH:-exp/w8-groups.patch} && git -c user.name=bench -c user.email=bench@localhost commit -qam "the patch" && ALT=$(git rev-parse --short HEAD)
echo "base $BASE alt $ALT" >> $R/gpu.txt; git diff $BASE $ALT --stat >> $R/gpu.txt
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $R/top.txt 2>&1) & TOP=$!
SETTLE_S=40 PYTHONPATH=/tmp/site timeout $(left ${BMAX:-440}) scripts/bench_trees.sh /tmp/t ${ROUNDS:-1} $BASE $ALT -- bench gpu --shape qwen2-vl-2b \
  --cache /tmp/cache --batch-sizes 1 --weights w8a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
kill $TOP 2>/dev/null
mkdir -p $R/bench; cp /tmp/t/compare.md /tmp/t/trees.log /tmp/t/*.log $R/bench/ 2>/dev/null
for d in /tmp/t/*-[0-9]*/; do t=$(basename $d); mkdir -p $R/bench/$t; cp $d/* $R/bench/$t/; done 2>/dev/null
for f in $R/bench/*/gpu-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
k = next(iter(d["results"].values()))["diagnostics"]["kernels"]
print(sys.argv[1].split("/")[-2], {n: {b: round(v["decode_in_call_tok_s"]["median"], 1) for b, v in s.items()} for n, s in d["summary"].items()},
      "step", k["step"]["in_step_us"], {n: (p.get("config"), p.get("us")) for n, p in k["products"].items()},
      "quiet", d["quiet"]["publishable"], d["quiet"]["worst_others_load"])
PY
done > $R/bench-summary.txt 2>&1
save
git checkout -q $BASE
if [ "$(left $((MAX - 20)))" -gt 60 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout $(left $((MAX - 15))) python3 -m pytest -q -s tests/test_quant_packed.py -k "against_dense or dense_tokens" -p no:cacheprovider > $R/tests.log 2>&1
  echo "tests rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
fi
save; cut -c1-900 $R/bench-summary.txt; cut -c1-300 $R/gpu.txt; tail -3 $R/bench.log; grep -E "divergence|passed|failed" $R/tests.log | tail -12
