#!/usr/bin/env bash
# The staged kernel with x's chunks asked for at once and spread over the warps, and tiles of two 16-row blocks a warp at one row (this checkout, new), against the submitted commit (HEAD, old).
# On an H100: every staged tile of the four one-row products, old then new, each tree in its own process; then 4-bit batch-1 decode, old and new in turns, two rounds.
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
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
finish() { echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt; tar czf $OUT/rec.tgz -C $R .; cat $R/gpu.txt; grep -v "^$" $R/compare*.md 2>/dev/null | head -30; }
if grep -q H200 $R/gpu.txt; then
  PYTHONPATH=/tmp/site:$PWD timeout $(left 470) scripts/bench_trees.sh /tmp/b 1 WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1,16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
  cp /tmp/b/compare.md $R/compare.md 2>/dev/null; tar czf $R/bench.tgz -C /tmp/b --exclude ./trees . 2>/dev/null
  finish; exit 0
fi
mkdir -p /tmp/old && git archive HEAD | tar x -C /tmp/old
for t in old new; do
  case $t in new) P=/tmp/site:$PWD;; old) P=/tmp/site:/tmp/old;; esac
  OUT=$R TAG=$t ROUNDS=3 PYTHONPATH=$P timeout $(left 120) python3 scripts/probe_staged_tiles.py > $R/tiles-$t.txt 2>&1
  echo "one-row tiles $t rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
done
echo "load before bench: $(cat /proc/loadavg)" >> $R/gpu.txt
PYTHONPATH=/tmp/site:$PWD timeout $(left 470) scripts/bench_trees.sh /tmp/b 2 HEAD WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
cp /tmp/b/compare.md $R/compare.md 2>/dev/null; tar czf $R/bench.tgz -C /tmp/b --exclude ./trees . 2>/dev/null
finish
