# Three trees in turns, three rounds, on a 2-core x86 machine with nothing else running, Triton 3.9.0:
#   before: 920444a (a compare a column of x); word checks: 44188b3; whole-steps peel: 5cc4582's kernel with
#   the one-step rows left out of the peel (SHORT_ROW, never committed).
# Each tree is its own checkout at TREE; OUT collects each run's JSON.
set -u
for r in 1 2 3; do
  for TREE in before word-checks whole-steps-peel; do
    (cd $TREE && PYTHONPATH=. python scripts/probe_compile_ahead.py --out OUT/$TREE/r$r --pairs 1 --arch 87 \
      --integer-dot --head-bits 4)
    echo "$TREE r$r rc $? $(date +%T) load $(cat /proc/loadavg)"
  done
done
