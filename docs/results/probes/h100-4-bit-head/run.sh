#!/usr/bin/env bash
# bench gpu on this checkout: batch 1, 4 and 16, bf16, 8-bit and 4-bit (int8 head), each format in its own process,
# medians of 3. top beside it. One file back: $OUT/rec.tgz.
set -u
MAX=${MAX:-585}
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
if [ "${TEST:-1}" = 1 ]; then  # the 8-bit per-channel decoder against the dense one, 8-bit integer-dot tiles among the candidates
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -s tests/test_quant_packed.py -k "against_dense or dense_tokens" -p no:cacheprovider > $R/tests.log 2>&1
  echo "tests rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
fi
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,14p; done > $R/top.txt 2>&1) & TOP=$!
save() { tar czf $OUT/rec.tgz -C $R . 2>/dev/null; }
PYTHONPATH=/tmp/site timeout $(left $((MAX - 10))) scripts/bench_trees.sh /tmp/t 1 WORKTREE -- bench gpu --shape qwen2-vl-2b \
  --cache /tmp/cache --batch-sizes ${BS:-1,4,16} --weights ${W:-bf16,w8a16-h8,w4a16-h8} --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
mkdir -p $R/bench; cp /tmp/t/compare.md /tmp/t/trees.log /tmp/t/WORKTREE-1/* $R/bench/ 2>/dev/null
kill $TOP 2>/dev/null
for f in $R/bench/gpu-*.json; do [ -f $f ] && python3 - $f <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, s in d["summary"].items():
    print(name, {b: round(v["decode_in_call_tok_s"]["median"], 1) for b, v in s.items()})
print("rooflines", {n: {b: round(v["fraction"], 3) for b, v in r.items()} for n, r in d["rooflines"].items()}, "quiet", d["quiet"]["publishable"], d["quiet"]["worst_others_load"])
PY
done > $R/bench-summary.txt 2>&1
save; cat $R/bench-summary.txt | cut -c1-600; cut -c1-300 $R/gpu.txt; tail -5 $R/bench.log
