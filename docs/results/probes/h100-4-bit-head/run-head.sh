#!/usr/bin/env bash
# The 4-bit lm_head (w4a16-h4) against the int8 one (w4a16-h8) at batch 1 and 16, each format in its own process,
# in one bench run (ORDER=rev runs h4 first); on an H200 bf16 first as well. Then, with the time left, the GPU tests
# of the packed decoders against the dense ones for the 4-bit-head checkpoint and the 8-bit one (T seconds).
set -u
T0=$(date +%s)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then PRE=bf16,; else PRE=; fi
if [ "${ORDER:-fwd}" = rev ]; then W=${PRE}w4a16-h4,w4a16-h8; else W=${PRE}w4a16-h8,w4a16-h4; fi
echo "formats $W"
MAX=${BMAX:-560} BS=${BS:-1,16} W=$W TEST=0 bash exp/dev-present.sh
if [ "${T:-0}" -gt 0 ]; then
  left=$(( ${MAX:-585} - ($(date +%s) - T0) - 10 )); [ $left -gt ${T} ] && left=${T}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
  PYTHONPATH=/tmp/site:$PWD timeout $left python3 -m pytest -q -s tests/test_quant_packed.py -p no:cacheprovider \
    -k "(against_dense or dense_tokens) and (w4_g32_h4 or w8_channel)" > /tmp/rec/tests.log 2>&1
  echo "tests rc $? at $(( $(date +%s) - T0 )) s (limit $left); load $(cat /proc/loadavg)" >> /tmp/rec/gpu.txt
  tar czf $OUT/rec.tgz -C /tmp/rec .
  grep -hE "divergence|passed|failed|Error" /tmp/rec/tests.log | tail -12; tail -2 /tmp/rec/gpu.txt
fi
