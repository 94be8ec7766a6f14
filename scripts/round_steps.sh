# Sourced by cpu_round.sh and gpu_round.sh: `step NAME ARGS...` runs `edgeinfer ARGS...`, logs it
# to $OUT/round.log with its time, and records NAME in `failed` when it fails, so later steps run.
failed=()
step() {
    local name=$1
    shift
    local started=$SECONDS
    echo "== $name: edgeinfer $*" | tee -a "$OUT/round.log"
    if python -m edgeinfer.cli.main "$@" 2>&1 | tee -a "$OUT/round.log"; then
        echo "== $name: done in $((SECONDS - started)) s" | tee -a "$OUT/round.log"
    else
        echo "== $name: FAILED after $((SECONDS - started)) s" | tee -a "$OUT/round.log"
        failed+=("$name")
    fi
}
