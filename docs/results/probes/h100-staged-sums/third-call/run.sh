#!/usr/bin/env bash
# The staged kernel's floor at one row: a copy whose chunks do no arithmetic on their words (copies, waits, x and the epilogue only), beside the kernel as it is (this checkout) and the kernel before (HEAD), each tree in its own process.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
mkdir -p /tmp/old && git archive HEAD | tar x -C /tmp/old
for t in nomath new old; do
  case $t in nomath) P=/tmp/site:$PWD/exp/nomath; C=0;; new) P=/tmp/site:$PWD; C=1;; old) P=/tmp/site:/tmp/old; C=1;; esac
  OUT=$OUT TAG=$t ROUNDS=3 CHECK=$C PYTHONPATH=$P timeout $(left 150) python3 scripts/probe_staged_tiles.py > $OUT/tiles-$t.txt 2>&1
  echo "one-row tiles $t rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt
done
echo "load after: $(cat /proc/loadavg)" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -4 $OUT/tiles-*.txt
