#!/usr/bin/env bash
# Regenerate every GPU figure of docs/benchmarks.md and docs/kv_cache.md in one run on one GPU.
#
#   scripts/gpu_round.sh OUT
#
# Writes into OUT (one raw JSON file per benchmark, each with a .md summary beside it):
#   gpu-qwen2-vl-2b.json    ours vs transformers (static cache + torch.compile, and dynamic), batch 1/4/16,
#                           decode only and whole request, first token, peak memory, bandwidth best of three
#   gpu-smolvlm-256m.json   the same on a SmolVLM-256M-shaped checkpoint
#   gpu-qwen2-vl-2b-bf16-w8a16-w4a16.json
#                           ours on the Qwen2-VL-2B shape as built (bf16) and quantized by `edgeinfer quantize`
#                           (rtn, group 128) to W8A16 and W4A16, batch 1/4/16: decode, first token, memory,
#                           each format's share of its own byte roofline, the Jetson projection
#   kv-cuda.json            KV spill manager: resume, spill overhead end to end, round robin, offloading peer, drift
#   gpu-qwen3-vl-2b.json, gpu-gemma-3-4b.json
#                           the newer families at batch 1, ours vs transformers static cache + compile
#   sleep-cuda-qwen2-vl-2b.json
#                           memory a level-1 / level-2 sleep frees, wake to the next first token
#   gpu-qwen2-vl-2b-greedy-sampled.json
#                           batch 1, every request greedy and then sampled (temperature 0.7, top-p 0.9), ours and
#                           transformers static + compile
#   serve-cuda-qwen2-vl-2b.json
#                           a burst of 32 requests, first-seen batch sizes, open-loop arrivals to saturation
#   gpu-qwen2-vl-2b-b16-b64.json, gpu-qwen2-vl-2b-b16-256tok.json
#                           batched decode: 16 and 64 rows, ours vs transformers static cache + compile
#   serve-cuda-qwen2-vl-2b-batch32.json
#                           the serving benchmark with 32 requests decoding at once
#   decode-vs-batch.png, open-loop.png
#                           plots of the batch sizes and of the open loop (only where matplotlib is installed:
#                           pip install -e '.[plot]')
#   round.log               everything the commands printed
# Checkpoints (random weights, published shapes) are built under $EDGEINFER_BENCH_CACHE (default
# OUT/checkpoints), about 9 GB for Qwen2-VL-2B (its W8A16, W4A16 and W4A16-with-int8-head copies, written on the CPU
# the first time, add about 5.6 GB). No network is used.
#
# Budget: the first three steps took about 12 minutes of GPU time on an H200 (most of it
# transformers' compilation, once per batch size); the newer-family, sleep and serve steps add
# more (Gemma-3-4B's transformers compile alone passed 4.5 minutes); the weights step quantizes
# three times on the CPU the first time (about 15 s each on 16 cores) and runs ours once per
# format (70-105 s each at batch 1, 4 and 16). Every step goes on when
# an earlier one failed; the script exits non-zero if any did.
set -euo pipefail

OUT=${1:?usage: scripts/gpu_round.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CACHE=${EDGEINFER_BENCH_CACHE:-$OUT/checkpoints}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"

python - <<'EOF'
import sys
missing = []
try:
    import torch
except ImportError:
    sys.exit("gpu_round: torch is not installed")
if not torch.cuda.is_available():
    missing.append("no CUDA device is visible to torch")
for name, why in (("transformers", "the peer"), ("triton", "our fused batch-1 decode (without it the figures are "
                                                                "not the engine's)"), ("psutil", "the load records"),
                  ("compressed_tensors", "the W8A16 / W4A16 checkpoints of the weights step")):
    try:
        __import__(name)
    except ImportError:
        missing.append(f"{name} is not installed ({why})")
try:
    import edgeinfer.bench.gpu, edgeinfer.bench.kv, edgeinfer.cli.main  # noqa: F401
except Exception as error:  # noqa: BLE001 - any import failure stops the round here
    missing.append(f"edgeinfer does not import: {error}")
if missing:
    sys.exit("gpu_round: cannot start: " + "; ".join(missing))
import transformers
print(f"gpu_round: {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF

# shellcheck source=scripts/round_steps.sh
source "$ROOT/scripts/round_steps.sh"
step gpu-qwen2-vl-2b bench gpu --shape qwen2-vl-2b --cache "$CACHE" --out "$OUT" \
    --image-size 1024x768 --batch-sizes 1,4,16 --new-tokens 64 --repeats 3 --warmup 1 --dtype bfloat16 \
    --kinds ours,transformers-static,transformers-dynamic
step gpu-smolvlm-256m bench gpu --shape smolvlm-256m --cache "$CACHE" --out "$OUT" \
    --image-size 1024x768 --batch-sizes 1,4,16 --new-tokens 64 --repeats 3 --warmup 1 --dtype bfloat16 \
    --kinds ours,transformers-static,transformers-dynamic
step gpu-qwen2-vl-2b-weights bench gpu --shape qwen2-vl-2b --cache "$CACHE" --out "$OUT" \
    --image-size 1024x768 --batch-sizes 1,4,16 --new-tokens 64 --repeats 3 --warmup 1 --dtype bfloat16 \
    --weights bf16,w8a16,w4a16,w4a16-h8 --group-size 128 --kinds ours
step kv-cuda bench kv --device cuda --dtype bfloat16 --shape smolvlm-256m --cache "$CACHE" --out "$OUT" \
    --parts resume,overhead,round_robin,peer,drift --repeats 3 --sessions 8 --rounds 3 --new-tokens 16
# A step whose file name another step also writes goes into a folder named after the step and is
# moved up under that name: publish STEP FILE_STEM.
publish() {
    local ext
    for ext in json md; do
        [[ -f "$OUT/$1/$2.$ext" ]] || continue
        sed "s/\`$2.json\`/\`$1.json\`/" "$OUT/$1/$2.$ext" > "$OUT/$1.$ext" && rm "$OUT/$1/$2.$ext"
    done
}
# Batched decode: 16 and 64 rows beside transformers, then 16 rows over a longer decode (256
# tokens, 5 repeats), where the prefill's variance weighs less on the decode-only figure.
step gpu-qwen2-vl-2b-b16-b64 bench gpu --shape qwen2-vl-2b --cache "$CACHE" --out "$OUT/gpu-qwen2-vl-2b-b16-b64" \
    --image-size 1024x768 --batch-sizes 16,64 --new-tokens 64 --repeats 3 --warmup 1 --dtype bfloat16 \
    --kinds ours,transformers-static --engine-timeout 300
publish gpu-qwen2-vl-2b-b16-b64 gpu-qwen2-vl-2b
step gpu-qwen2-vl-2b-b16-256tok bench gpu --shape qwen2-vl-2b --cache "$CACHE" --out "$OUT/gpu-qwen2-vl-2b-b16-256tok" \
    --image-size 1024x768 --batch-sizes 16 --new-tokens 256 --repeats 5 --warmup 1 --dtype bfloat16 \
    --kinds ours,transformers-static --engine-timeout 300
publish gpu-qwen2-vl-2b-b16-256tok gpu-qwen2-vl-2b
step gpu-qwen3-vl-2b bench gpu --shape qwen3-vl-2b --cache "$CACHE" --out "$OUT" \
    --image-size 1024x768 --batch-sizes 1 --new-tokens 64 --repeats 3 --warmup 1 --dtype bfloat16 \
    --kinds ours,transformers-static
# transformers' compilation of Gemma 3 takes minutes: the limit keeps our figures if it never ends.
step gpu-gemma-3-4b bench gpu --shape gemma-3-4b --cache "$CACHE" --out "$OUT" \
    --image-size 1024x768 --batch-sizes 1 --new-tokens 128 --repeats 3 --warmup 1 --dtype bfloat16 \
    --kinds ours,transformers-static --engine-timeout 600
step gpu-qwen2-vl-2b-greedy-sampled bench gpu --shape qwen2-vl-2b --cache "$CACHE" --out "$OUT" \
    --image-size 1024x768 --batch-sizes 1 --new-tokens 64 --repeats 3 --warmup 1 --dtype bfloat16 \
    --kinds ours,transformers-static --sampling greedy,sampled
step sleep-cuda-qwen2-vl-2b bench sleep --shape qwen2-vl-2b --profile cuda --cache "$CACHE" --out "$OUT" --repeats 3
step serve-cuda-qwen2-vl-2b bench serve --shape qwen2-vl-2b --profile cuda --cache "$CACHE" --out "$OUT"
# The same with 32 requests decoding at once (the profile as shipped serves 8).
step serve-cuda-qwen2-vl-2b-batch32 bench serve --shape qwen2-vl-2b --profile cuda --cache "$CACHE" \
    --out "$OUT/serve-cuda-qwen2-vl-2b-batch32" --set runtime.max_batch_size=32 --set build.decoder_batch.max=32 \
    --set server.max_concurrent=32 --set server.max_queue=64 --set runtime.max_context_tokens=2048 \
    --first-seen 0 --rates 8,16,32,64 --requests 32
publish serve-cuda-qwen2-vl-2b-batch32 serve-cuda-qwen2-vl-2b

if python -c "import matplotlib" 2>/dev/null; then
    python scripts/plot_bench.py "$OUT"/gpu-qwen2-vl-2b.json "$OUT"/gpu-qwen2-vl-2b-b16-b64.json \
        --out "$OUT/decode-vs-batch.png" 2>&1 | tee -a "$OUT/round.log"
    python scripts/plot_bench.py "$OUT"/serve-cuda-qwen2-vl-2b.json "$OUT"/serve-cuda-qwen2-vl-2b-batch32.json \
        --out "$OUT/open-loop.png" 2>&1 | tee -a "$OUT/round.log"
else
    echo "gpu_round: no matplotlib here; plot later with: python scripts/plot_bench.py $OUT/gpu-*.json --out $OUT/decode-vs-batch.png" | tee -a "$OUT/round.log"
fi

echo "gpu_round: $SECONDS s in all; raw files in $OUT" | tee -a "$OUT/round.log"
if ((${#failed[@]})); then
    echo "gpu_round: failed: ${failed[*]} (see $OUT/round.log)" >&2
    exit 1
fi
