#!/usr/bin/env bash
# On an H200: the #18 batch-16 ratio (bf16 and 4-bit in one run) and 4-bit batch 1, the submitted commit (HEAD).
# Elsewhere: the staged kernel's one-row GPU tests on this checkout, after the staged kernel at one row taken apart: copies alone, arithmetic alone, neither, and the arithmetic without x or without unpacking the words, beside the kernel as submitted (HEAD, old) with x's chunks asked for at once (xonce) and also spread over the warps (this checkout, new), each tree in its own process.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
if grep -q H200 $OUT/gpu.txt; then
  export PYTHONPATH=/tmp/site:$PWD
  echo "load before b16: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  timeout $(left 420) scripts/bench_trees.sh /tmp/b16 1 HEAD -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 16 --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/b16.log 2>&1
  echo "b16 bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/b16/compare.md $OUT/compare-b16.md 2>/dev/null; tar czf $OUT/b16.tgz -C /tmp/b16 --exclude ./trees . 2>/dev/null
  echo "load before b1: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  timeout $(left 590) scripts/bench_trees.sh /tmp/b1 1 HEAD -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $OUT/b1.log 2>&1
  echo "b1 bench rc $? at $(( $(date +%s) - T0 )) s; load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
  cp /tmp/b1/compare.md $OUT/compare-b1.md 2>/dev/null; tar czf $OUT/b1.tgz -C /tmp/b1 --exclude ./trees . 2>/dev/null
  cat $OUT/gpu.txt; for f in $OUT/compare-*.md; do grep -v "^$" $f | head -14; done
  exit 0
fi
mkdir -p /tmp/old && git archive HEAD | tar x -C /tmp/old
for t in old new xonce nomath nocopy neither nox nounpack old2 new2; do
  case $t in new*) P=/tmp/site:$PWD; C=1;; old*) P=/tmp/site:/tmp/old; C=1;; *) P=/tmp/site:$PWD/exp/$t; C=0;; esac
  OUT=$OUT TAG=$t ROUNDS=3 CHECK=$C PYTHONPATH=$P timeout $(left 420) python3 scripts/probe_staged_tiles.py > $OUT/tiles-$t.txt 2>&1
  echo "one-row tiles $t rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
done
PYTHONPATH=/tmp/site:$PWD timeout $(left 580) python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_quant_staged.py -k "step_s_check or decode_on_staged" > $OUT/tests.log 2>&1
echo "one-row staged GPU tests (this checkout) rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
echo "load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -4 $OUT/tiles-*.txt; tail -3 $OUT/tests.log
