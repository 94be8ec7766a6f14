#!/usr/bin/env bash
# bench gpu at batch 4 and 16, bf16 and 4-bit, each format in its own worker, with decode in the call
# counting the tokens made after the last row's first token (787e716).
set -u
T0=$(date +%s)
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $OUT/gpu.txt
(while sleep 10; do date +%T; top -bn1 -w 180 | sed -n 1,12p; done > $OUT/top.txt 2>&1) & TOP=$!
timeout $(( ${MAX:-570} - ($(date +%s) - T0) )) python3 -m edgeinfer.cli.main bench gpu --shape qwen2-vl-2b --cache /tmp/cache \
  --batch-sizes ${BS:-4,16} --weights bf16,w4a16-h8 --kinds ours --repeats 3 --warmup 1 --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $OUT/gpu.txt
kill $TOP 2>/dev/null
cat $OUT/gpu.txt; grep -v "it/s\]\|Warning\|warn" $OUT/bench.log | tail -30; cat $OUT/bench/*.md 2>/dev/null | head -60
