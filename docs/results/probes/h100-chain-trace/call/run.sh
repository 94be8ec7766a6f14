#!/usr/bin/env bash
# On an H100: 4-bit batch-1 decode, 7971e0d (before x was asked for at once) against HEAD (the committed kernel), two rounds in turns; then scripts/probe_chain_tiles.py (this checkout) and exp/probe_chain_trace.py (the trace copy, exp/trace).
# On an H200: the #18 benchmark of this checkout, bf16 and 4-bit at batches 1 and 16, one run.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=/tmp/rec; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files; 7971e0d: $(git cat-file -t 7971e0d 2>&1)" >> $R/gpu.txt
finish() { echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt; tar czf $OUT/rec.tgz -C $R .; cat $R/gpu.txt; grep -v "^$" $R/compare*.md 2>/dev/null | head -30; cat $R/chain.txt 2>/dev/null | tail -22; }
if grep -q H200 $R/gpu.txt; then
  PYTHONPATH=/tmp/site:$PWD timeout $(left 470) scripts/bench_trees.sh /tmp/b 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
  cp /tmp/b/compare.md $R/compare.md 2>/dev/null; tar czf $R/bench.tgz -C /tmp/b --exclude ./trees . 2>/dev/null
  finish; exit 0
fi
PYTHONPATH=/tmp/site:$PWD timeout $(left 340) scripts/bench_trees.sh /tmp/b 2 7971e0d HEAD -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load: $(cat /proc/loadavg)" >> $R/gpu.txt
cp /tmp/b/compare.md $R/compare.md 2>/dev/null; tar czf $R/bench.tgz -C /tmp/b --exclude ./trees . 2>/dev/null
OUT=$R ROUNDS=5 PYTHONPATH=/tmp/site:$PWD timeout $(left 470) python3 scripts/probe_chain_tiles.py > $R/chain.txt 2>&1
echo "chain rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
OUT=$R PYTHONPATH=/tmp/site:$PWD/exp/trace timeout $(left 575) python3 exp/probe_chain_trace.py > $R/trace.txt 2>&1
echo "trace rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
finish; tail -c 3000 $R/trace.txt
