#!/usr/bin/env bash
# The staged kernel at several rows: x through two shared buffers (WORKTREE) against HEAD's layout
# conversion; GPU tests first, then the probe alone with the step's fusions, trees in turns.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
PYTHONPATH=/tmp/site python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
rm -rf /tmp/head && mkdir -p /tmp/head && git archive HEAD | tar -x -C /tmp/head
cp edgeinfer/testing/products.py /tmp/head/edgeinfer/testing/products.py  # the probe's inputs for several rows
PYTHONPATH=/tmp/site:$PWD timeout ${TESTS_S:-170} python3 -m pytest -q -x -p no:cacheprovider tests/test_quant_staged.py -k "several_rows and not dtype1" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
for r in 1 2; do
  for t in head new; do
    dir=$PWD; [ $t = head ] && dir=/tmp/head
    echo "$t $r load $(cat /proc/loadavg)" >> $OUT/gpu.txt
    PYTHONPATH=/tmp/site:$dir timeout $(left 585) python3 scripts/probe_staged_rows.py --fused --rows ${ROWS:-16} --rounds 3 \
      --out $OUT/alone-$t-$r.json > $OUT/alone-$t-$r.log 2>&1
    echo "$t $r rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
  done
done
echo "load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -3 $OUT/tests.log; grep -h "^[a-z_]* [0-9]* staged" $OUT/alone-*.log
true
