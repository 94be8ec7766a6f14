"""``scripts/bench_trees.sh``: each run after the first waits for the load the run before left to settle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _trees(tmp_path: Path, load: str, settle_s: str) -> str:
    """bench_trees.sh over two runs of this checkout (the second with a variable set), each only printing
    ``bench gpu``'s help, with the 1-minute load average read as ``load``; its trees.log."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text(f"{load} {load} {load} 1/100 4242\n")
    out = tmp_path / "out"
    env = {**os.environ, "BENCH_LOADAVG": str(loadavg), "SETTLE_S": settle_s,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "bench_trees.sh"), str(out), "1", "WORKTREE",
                           "SOME_SWITCH=1@WORKTREE", "--", "bench", "gpu", "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return (out / "trees.log").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to run the script")
def test_a_run_after_another_waits_for_the_load_to_fall_to_the_quiet_limit_for_at_most_settle_s(tmp_path):
    log = _trees(tmp_path, "9.00", "2")
    first, second = log.index("== WORKTREE-1, load 9.00"), log.index("== SOME_SWITCH_1_WORKTREE-1, load 9.00")
    waited = log.index("== waited 2 s for the 1-minute load average to fall to 1.5; it is 9.00")
    assert first < waited < second, log  # the first run does not wait; the second waits, and no longer than asked
    assert log.count("== waited") == 1, log


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to run the script")
def test_a_quiet_machine_is_not_waited_for(tmp_path):
    log = _trees(tmp_path, "0.40", "30")
    assert "== SOME_SWITCH_1_WORKTREE-1, load 0.40" in log and "waited" not in log, log
