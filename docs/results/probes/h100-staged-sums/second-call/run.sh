#!/usr/bin/env bash
# The staged kernel with each chunk's Σx summed in float32 (this checkout) against the kernel before (HEAD): the several-rows GPU tests, a mutated copy's test (must fail), then every staged tile alone at one row and at 16 rows, each tree in its own process.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
mkdir -p /tmp/old && git archive HEAD | tar x -C /tmp/old
NEW=/tmp/site:$PWD OLD=/tmp/site:/tmp/old
PYTHONPATH=$NEW timeout $(left 110) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_staged.py \
  -k "several_rows and torch_s" > $OUT/tests-several-rows.log 2>&1
echo "several-rows GPU tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
(cd exp/mut && PYTHONPATH=/tmp/site:$PWD timeout $(left 150) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_quant_staged.py -k "step_s_check and plain and symmetric") > $OUT/mutation.log 2>&1
echo "mutated copy's test rc $? (1: caught) at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
for t in old new; do
  [ $t = old ] && P=$OLD || P=$NEW
  OUT=$OUT TAG=$t ROUNDS=3 PYTHONPATH=$P timeout $(left $([ $t = old ] && echo 205 || echo 260)) \
    python3 scripts/probe_staged_tiles.py > $OUT/tiles-$t.log 2>&1
  echo "one-row tiles $t rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
done
for t in old new; do
  [ $t = old ] && P=$OLD || P=$NEW
  OUT=$OUT/rows-$t.json PYTHONPATH=$P timeout $(left $([ $t = old ] && echo 285 || echo 310)) \
    python3 scripts/probe_staged_rows.py --rows 16 --rounds 2 --shapes gate_up,down > $OUT/rows-$t.log 2>&1
  echo "16-row tiles $t rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
done
echo "load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -2 $OUT/tests-several-rows.log; tail -2 $OUT/mutation.log; cat $OUT/tiles-*.log | tail -12; tail -3 $OUT/rows-*.log
