#!/usr/bin/env bash
# Time several trees of this repository in one run, taking turns, each from its own copy.
#
#   scripts/bench_trees.sh OUT ROUNDS TREE [TREE ...] -- EDGEINFER-ARGS...
#   scripts/bench_trees.sh /tmp/trees 2 47b78d2 WORKTREE -- bench gpu --shape qwen2-vl-2b \
#       --cache /tmp/cache --batch-sizes 1 --weights w4a16-h8 --kinds ours --repeats 5 --warmup 2
#
# A TREE is a revision, unpacked with `git archive` into OUT/trees/TREE, or WORKTREE, this checkout
# as it is (uncommitted changes included), optionally after VAR=VALUE assignments joined by `@`,
# which its runs get in their environment: EDGEINFER_STAGED_PRODUCTS=0@WORKTREE is this checkout
# with the staged products' switch off (its runs' folder: EDGEINFER_STAGED_PRODUCTS_0_WORKTREE). Round r runs every tree in the order given:
# `python -m edgeinfer.cli.main EDGEINFER-ARGS --out OUT/TREE-r`, from the tree's copy and with it
# first on PYTHONPATH, so the report and every engine worker it starts import that tree. Give the
# trees one --cache, as an absolute path (each run starts in its own folder): a checkpoint built
# or quantized once serves them all. Then
# scripts/compare_bench_runs.py puts every run side by side and pools each tree's runs into
# OUT/compare.md (gpu benchmarks). A run that fails is named at the end and the others go on;
# the script then exits non-zero.
#
# Each run but the first waits, up to SETTLE_S seconds (120; 0: not at all), for the 1-minute load
# average to fall to the benchmark's quiet limit (edgeinfer.bench.quiet.QUIET_LOAD): what the run
# before left in it would count as other processes' load in this run's raw file. trees.log says how
# long each waited. (BENCH_LOADAVG names the file the load is read from: /proc/loadavg.)
set -uo pipefail
# Every run times its own tiles (the tile cache off, unless the caller names one): a tree's runs
# are then samples of its tuning too, not of the first run's choices.
export EDGEINFER_TILE_CACHE=${EDGEINFER_TILE_CACHE:-off}

usage="usage: scripts/bench_trees.sh OUT ROUNDS TREE [TREE ...] -- EDGEINFER-ARGS..."
OUT=${1:?$usage}
ROUNDS=${2:?$usage}
shift 2
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    trees+=("$1")
    shift
done
[ "${1:-}" = "--" ] && [ ${#trees[@]} -gt 0 ] && [ $# -gt 1 ] || { echo "$usage" >&2; exit 2; }
shift
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a whole number >= 1, got $ROUNDS" >&2; exit 2; }
for arg in "$@"; do
    [ "$arg" = "--out" ] && { echo "bench_trees.sh gives each run its own --out; leave it out" >&2; exit 2; }
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SETTLE_S=${SETTLE_S:-120}
[[ $SETTLE_S =~ ^[0-9]+$ ]] || { echo "SETTLE_S must be a whole number of seconds, got $SETTLE_S" >&2; exit 2; }
LOADAVG=${BENCH_LOADAVG:-/proc/loadavg}
QUIET=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        python -c "from edgeinfer.bench.quiet import QUIET_LOAD; print(QUIET_LOAD)") \
    || { echo "bench_trees.sh: cannot read the quiet limit from $ROOT's edgeinfer" >&2; exit 2; }

# Waits while the 1-minute load average is over $QUIET, SETTLE_S seconds at most; says how long.
settle() {
    local waited=0 load
    load=$(cut -d' ' -f1 "$LOADAVG" 2>/dev/null)
    while [ "$waited" -lt "$SETTLE_S" ] && awk -v l="${load:-0}" -v q="$QUIET" 'BEGIN { exit !(l > q) }'; do
        sleep 1
        waited=$((waited + 1))
        load=$(cut -d' ' -f1 "$LOADAVG" 2>/dev/null)
    done
    [ "$waited" -gt 0 ] \
        && echo "== waited $waited s for the 1-minute load average to fall to $QUIET; it is ${load:-unknown}" \
        | tee -a "$OUT/trees.log"
    return 0
}

mkdir -p "$OUT/trees"
OUT=$(cd "$OUT" && pwd)
declare -A dir label env rev
for tree in "${trees[@]}"; do
    label[$tree]=${tree//[^A-Za-z0-9._]/_}  # a folder name: HEAD~1 -> HEAD_1
    rev[$tree]=${tree##*@}
    env[$tree]=""
    if [ "${rev[$tree]}" != "$tree" ]; then
        env[$tree]=${tree%@*}
        for assignment in ${env[$tree]//@/ }; do
            [[ $assignment =~ ^[A-Za-z_][A-Za-z0-9_]*=[^[:space:]]*$ ]] \
                || { echo "bench_trees.sh: $assignment (in $tree) is not VAR=VALUE" >&2; exit 2; }
        done
    fi
    if [ "${rev[$tree]}" = WORKTREE ]; then
        dir[$tree]=$ROOT
        echo "== $tree: $(git -C "$ROOT" rev-parse --short HEAD) and this checkout's uncommitted changes" \
            | tee -a "$OUT/trees.log"
    else
        git -C "$ROOT" rev-parse --verify --quiet "${rev[$tree]}^{commit}" >/dev/null \
            || { echo "bench_trees.sh: ${rev[$tree]} is not a revision of this repository" >&2; exit 2; }
        dir[$tree]=$OUT/trees/${label[$tree]}
        rm -rf "${dir[$tree]}" && mkdir -p "${dir[$tree]}"
        git -C "$ROOT" archive "${rev[$tree]}" | tar -x -C "${dir[$tree]}"
        echo "== $tree: $(git -C "$ROOT" rev-parse --short "${rev[$tree]}")" | tee -a "$OUT/trees.log"
    fi
done

failed=()
first=1
for round in $(seq 1 "$ROUNDS"); do
    for tree in "${trees[@]}"; do
        run=${label[$tree]}-$round
        [ $first = 1 ] || settle
        first=0
        echo "== $run, load $(cut -d' ' -f1-3 "$LOADAVG" 2>/dev/null): edgeinfer $*" | tee -a "$OUT/trees.log"
        # shellcheck disable=SC2086  # the assignments were checked to hold no spaces
        if (cd "${dir[$tree]}" && env ${env[$tree]//@/ } PYTHONPATH="${dir[$tree]}${PYTHONPATH:+:$PYTHONPATH}" \
                python -m edgeinfer.cli.main "$@" --out "$OUT/$run") >"$OUT/$run.log" 2>&1; then
            echo "== $run: done" | tee -a "$OUT/trees.log"
        else
            echo "== $run: FAILED (its output: $OUT/$run.log)" | tee -a "$OUT/trees.log"
            failed+=("$run")
        fi
    done
done

shopt -s nullglob
raws=("$OUT"/*-[0-9]*/gpu-*.json)
if [ ${#raws[@]} -gt 0 ]; then
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python "$ROOT/scripts/compare_bench_runs.py" "${raws[@]}" \
        >"$OUT/compare.md" && echo "== side by side: $OUT/compare.md" | tee -a "$OUT/trees.log"
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "== failed: ${failed[*]}" | tee -a "$OUT/trees.log"
    exit 1
fi
