#!/usr/bin/env bash
# The shared memory carveout, on an H100. exp/carve is the kernels with the trace hooks (off unless a probe sets them) and
# EDGEINFER_CARVEOUT (each kernel's preferred carveout, percent, set after its first launch; EDGEINFER_CARVEOUT_KERNELS staged or all).
# 1. scripts/probe_chain_tiles.py (16 mixes of staged and packed_gemv tiles, ROUNDS=3) from exp/carve: no carveout set; 100 on the
#    staged kernel; each in its own process.
# 2. Where a carveout's fastest mix beats none by 0.3 µs a layer or more: 4-bit batch-1 decode, exp/carve without and with it, one round.
# 3. With the time left, exp/probe_chain_trace.py with the staged kernel's carveout at 100, then the chain probe from exp/carve with 100 on every kernel, from exp/late and from exp/lateboth (where the kernels let the next one launch).
set -u
MAX=${MAX:-560}  # seconds this script may run
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl -q 2>&1 | tail -1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec python3 \"\$@\"\n" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
R=/tmp/rec; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt 2>&1
echo "nproc $(nproc); load before: $(cat /proc/loadavg); git $(git rev-parse --short HEAD) dirty: $(git status --short | wc -l) files" >> $R/gpu.txt
for v in none staged; do
  mkdir -p $R/$v
  case $v in none) E="";; staged) E="EDGEINFER_CARVEOUT=100 EDGEINFER_CARVEOUT_KERNELS=staged";; all) E="EDGEINFER_CARVEOUT=100 EDGEINFER_CARVEOUT_KERNELS=all";; esac
  env $E OUT=$R/$v ROUNDS=3 PYTHONPATH=/tmp/site:$PWD/exp/carve timeout $(left $((MAX - 100))) python3 scripts/probe_chain_tiles.py > $R/$v/chain.txt 2>&1
  echo "chain $v rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
done
BEST=$(python3 - <<'PY'
import json
best = {}
for v in ("none", "staged", "all"):
    try:
        best[v] = min(c["median"] for c in json.load(open(f"/tmp/rec/{v}/probe-chain-tiles.json"))["chain_us_a_layer"])
    except Exception:
        pass
print(" ".join(f"{k}={v}" for k, v in best.items()), file=open("/tmp/rec/best.txt", "w"))
c = {k: v for k, v in best.items() if k != "none"}
k = min(c, key=c.get) if c and "none" in best else None
print(k if k and c[k] <= best["none"] - 0.3 else "")
PY
)
echo "best: $(cat $R/best.txt); decode for: ${BEST:-none}" >> $R/gpu.txt
if [ -n "$BEST" ] && [ $(left $MAX) -gt 200 ]; then
  rm -rf edgeinfer/quant edgeinfer/backends && cp -r exp/carve/edgeinfer/quant exp/carve/edgeinfer/backends edgeinfer/
  PYTHONPATH=/tmp/site:$PWD timeout $(left $MAX) scripts/bench_trees.sh /tmp/b 1 WORKTREE EDGEINFER_CARVEOUT=100@EDGEINFER_CARVEOUT_KERNELS=$BEST@WORKTREE -- bench gpu --shape qwen2-vl-2b --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 3 --warmup 1 > $R/bench.log 2>&1
  echo "bench rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
  cp /tmp/b/compare.md $R/compare.md 2>/dev/null; tar czf $R/bench.tgz -C /tmp/b --exclude ./trees . 2>/dev/null
fi
if [ $(left $MAX) -gt 70 ]; then
mkdir -p $R/trace
EDGEINFER_CARVEOUT=100 EDGEINFER_CARVEOUT_KERNELS=staged OUT=$R/trace PYTHONPATH=/tmp/site:$PWD/exp/carve timeout $(left $((MAX - 10))) python3 exp/probe_chain_trace.py > $R/trace/trace.txt 2>&1
echo "trace rc $? at $(( $(date +%s) - T0 )) s" >> $R/gpu.txt
python3 exp/trace_quantiles.py $R/trace/chain-trace-raw.pt $R/trace/trace-quantiles.json >> $R/gpu.txt 2>&1; rm -f $R/trace/chain-trace-raw.pt
fi
for v in all late lateboth; do
  [ $(left $MAX) -gt 70 ] || break
  mkdir -p $R/$v
  P=/tmp/site:$PWD/exp/$v; E=""; [ $v = all ] && P=/tmp/site:$PWD/exp/carve && E="EDGEINFER_CARVEOUT=100 EDGEINFER_CARVEOUT_KERNELS=all"
  env $E OUT=$R/$v ROUNDS=3 PYTHONPATH=$P timeout $(left $((MAX - 10))) python3 scripts/probe_chain_tiles.py > $R/$v/chain.txt 2>&1
  echo "chain $v rc $? at $(( $(date +%s) - T0 )) s; load $(cat /proc/loadavg)" >> $R/gpu.txt
done
echo "load after: $(cat /proc/loadavg)" >> $R/gpu.txt
tar czf $OUT/rec.tgz -C $R .; cat $R/gpu.txt; for v in none staged all late lateboth; do echo "== $v"; tail -17 $R/$v/chain.txt 2>/dev/null | cut -c1-200; done; grep -v "^$" $R/compare.md 2>/dev/null | head -12; tail -c 2500 $R/trace/trace.txt
