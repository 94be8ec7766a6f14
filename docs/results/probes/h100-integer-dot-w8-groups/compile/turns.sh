#!/usr/bin/env bash
# The 8-bit checkpoint's batch-1 candidates compiled for sm_87 on this machine's threads, the tree before the change
# (the integer-dot tiles for the head alone) and after (for the 8-bit layers too), in turns, each in a fresh process
# with Triton's cache empty.
#   turns.sh BEFORE-CHECKOUT AFTER-CHECKOUT > turns.jsonl   (PYTHON: an interpreter with Triton 3.6)
BEFORE=${1:?} AFTER=${2:?}
for pair in 1 2 3; do
  for tree in before after; do
    while awk -v l=$(cut -d' ' -f1 /proc/loadavg) 'BEGIN { exit !(l > 0.5) }'; do sleep 5; done
    dir=$([ $tree = before ] && echo $BEFORE || echo $AFTER)
    cache=$(mktemp -d)
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    out=$(cd $dir && TRITON_CACHE_DIR=$cache TRITON_DEFAULT_FP_FUSION=1 EDGEINFER_INTEGER_DOT=1 PYTHONPATH=$dir \
          ${PYTHON:-python} scripts/probe_compile_ahead.py --child ahead+idot --arch 87 --workers 2 --bits 8 --out /tmp/cw8t 2>/dev/null | tail -1)
    rm -rf $cache
    echo "{\"pair\": $pair, \"tree\": \"$tree\", \"load_before\": \"$load\", \"run\": $out}"
  done
done
