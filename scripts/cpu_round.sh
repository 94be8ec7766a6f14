#!/usr/bin/env bash
# Regenerate every CPU figure of docs/benchmarks.md and docs/kv_cache.md in one quiet run (2 cores).
#
#   scripts/cpu_round.sh OUT
#
# Writes into OUT (one raw JSON file per benchmark, each with a .md summary beside it):
#   cpu-onnxruntime-smolvlm-256m.json   transformers, ours (torch), ours (ONNX Runtime fp32, int8): first token,
#                                       decode, whole request, peak RSS; the ORT targets
#   kv-cpu.json                         KV spill manager: resume, spill overhead end to end, round robin,
#                                       compressed-tier drift, demo-model accuracy
#   round.log                           everything the commands printed
# The checkpoint (random weights, SmolVLM-256M's shapes) and the ONNX Runtime engines are built under
# $EDGEINFER_BENCH_CACHE (default OUT/checkpoints).
#
# Run it with nothing else on the machine: every run records the load average around it, and a
# command whose runs saw other processes' load above 1.5 exits 2 with its raw file marked
# "publishable": false. Budget: about 10 minutes on 2 cores. Every step goes on when an earlier
# one failed; the script exits non-zero if any did.
set -euo pipefail

OUT=${1:?usage: scripts/cpu_round.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CACHE=${EDGEINFER_BENCH_CACHE:-$OUT/checkpoints}
THREADS=${THREADS:-2}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"

python - <<'EOF'
import os
import sys

missing = []
for name, why in (("torch", "both engines"), ("transformers", "the peer"), ("onnxruntime", "the ORT backend"),
                  ("onnx", "the ORT export"), ("psutil", "the load records")):
    try:
        __import__(name)
    except ImportError:
        missing.append(f"{name} is not installed ({why})")
try:
    import edgeinfer.bench.kv, edgeinfer.bench.onnxruntime, edgeinfer.cli.main  # noqa: F401
    from edgeinfer.demo import DEMO_MODEL_DIR
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        missing.append(f"the demo model is missing ({DEMO_MODEL_DIR}): the demo-accuracy figure needs it")
except Exception as error:  # noqa: BLE001 - any import failure stops the round here
    missing.append(f"edgeinfer does not import: {error}")
if missing:
    sys.exit("cpu_round: cannot start: " + "; ".join(missing))
load = os.getloadavg()[0]
if load > 1.5:
    sys.exit(f"cpu_round: the machine is not quiet (1-minute load average {load:.2f}, limit 1.5); "
             "stop what else runs and start again when it has settled")
print(f"cpu_round: {os.cpu_count()} cores, load average {load:.2f}")
EOF

# shellcheck source=scripts/round_steps.sh
source "$ROOT/scripts/round_steps.sh"

step cpu-onnxruntime bench onnxruntime --shape smolvlm-256m --cache "$CACHE" --out "$OUT" \
    --image-size 512 --new-tokens 64 --repeats 3 --warmup 1 --threads "$THREADS"
step kv-cpu bench kv --device cpu --dtype float32 --shape smolvlm-256m --cache "$CACHE" --out "$OUT" \
    --threads "$THREADS" --parts resume,overhead,round_robin,drift,demo --repeats 3 --sessions 8 --rounds 3 \
    --new-tokens 16 --demo-questions 140

echo "cpu_round: $SECONDS s in all; raw files in $OUT" | tee -a "$OUT/round.log"
if ((${#failed[@]})); then
    echo "cpu_round: failed: ${failed[*]} (see $OUT/round.log)" >&2
    exit 1
fi
