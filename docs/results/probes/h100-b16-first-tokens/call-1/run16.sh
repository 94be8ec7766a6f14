#!/usr/bin/env bash
# Where a batch-16 call's decode goes after its last first token: 4-bit, then bf16.
set -u
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
for f in ${FMTS:-w4a16-h8 bf16}; do
  [ $(left ${MAX:-580}) -lt 60 ] && break
  timeout $(left ${MAX:-580}) python3 exp/probe_call16.py $f $OUT/call16-$f.json > $OUT/call16-$f.log 2>&1
  echo "$f rc $? at $(( $(date +%s) - T0 )) s; load: $(cat /proc/loadavg)" >> $OUT/gpu.txt
done
cat $OUT/gpu.txt; for f in ${FMTS:-w4a16-h8 bf16}; do echo "=== $f"; grep -v "Warning\|warn" $OUT/call16-$f.log 2>/dev/null | cut -c1-1500 | tail -40; done
