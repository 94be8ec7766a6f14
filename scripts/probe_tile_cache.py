"""Wall time of ``edgeinfer run`` on a GPU with the tile cache empty (every tile timed) and full
(every tile taken from it), the two taking turns.

    python scripts/probe_tile_cache.py --out DIR [--shape qwen2-vl-2b] [--weights w4a16-h8]
        [--pairs 3] [--cache /tmp/cache] [--max-tokens 16]

Builds (once, under ``--cache``) the random checkpoint of the shape and its quantized copy, as
``edgeinfer bench gpu`` does, and runs ``edgeinfer run`` once untimed with the tile cache off:
Triton's kernel cache, torch.compile's cache and the checkpoint's digests are then warm for every
timed run alike. Then ``--pairs`` times: the tile cache emptied, one run (``empty``), and one run
more (``full``). Each run is a process of its own, timed from its start to its exit, as a shell
user waits for it. After each run the cache file's entries and modification time are read: a
run that timed nothing leaves the file as it was.

Writes ``DIR/tile-cache-<shape>-<weights>.json``: every run's wall time, the load average before
and after it (and, under ``quiet``, other processes' share of it as the benchmarks judge it), its answer's token ids and what it left in the cache; and the medians of each
kind over all its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeinfer.bench.common import bench_checkpoint  # noqa: E402
from edgeinfer.bench.quiet import LoadTracker, RunLog, judge  # noqa: E402
from edgeinfer.bench.weights import format_checkpoint  # noqa: E402
from edgeinfer.tile_cache import TILE_CACHE_ENV  # noqa: E402

QUESTION = "Describe the picture."
IMAGE = ROOT / "examples" / "demo.jpg"


def cache_state(folder: Path) -> dict:
    """Each tile file's entries and modification time."""
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    return {f.name: {"entries": len(json.loads(f.read_text())["entries"]), "mtime_ns": f.stat().st_mtime_ns}
            for f in files}


def one_run(runs: RunLog, label: str, model: Path, tiles: str, max_tokens: int, timed: bool = True,
            env: dict[str, str] | None = None) -> dict:
    """One ``edgeinfer run`` process (``env`` added to ours), recorded in ``runs`` with the load before
    and after it."""
    env = {**os.environ, TILE_CACHE_ENV: tiles, **(env or {})}
    command = [sys.executable, "-m", "edgeinfer.cli.main", "run", "--model", str(model), "--image", str(IMAGE),
               "--max-tokens", str(max_tokens), "--json", QUESTION]
    with runs.run(label, timed) as record:
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
        record["wall_s"] = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"edgeinfer run exited with {done.returncode}:\n{done.stderr[-4000:]}")
    answer = json.loads(done.stdout)
    record.update(token_ids=answer["token_ids"], timings=answer["timings"], backend=answer["backend"],
                  precision=answer["precision"], profile=answer["profile"])
    return record


def summarize(record: dict, runs: RunLog, tracker: LoadTracker, field: str, kinds: tuple[str, ...]) -> None:
    """Into ``record``: the load verdict of its runs (recorded, not enforced: GPU figures) and the
    median wall time of each of ``kinds`` (the runs' ``field``) over all its runs."""
    record["quiet"] = judge(runs.records, tracker.share_at, enforced=False).to_dict()
    record["median_wall_s"] = {kind: statistics.median(r["wall_s"] for r in record["runs"] if r[field] == kind)
                               for kind in kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="qwen2-vl-2b")
    parser.add_argument("--weights", default="w4a16-h8")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/cache"))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--no-untimed", action="store_true",
                        help="skip the untimed run (the caches are warm from an earlier probe on this machine)")
    args = parser.parse_args()

    dense = bench_checkpoint(args.shape, args.cache)
    model = format_checkpoint(dense, args.weights, args.cache, args.group_size, "bfloat16")
    tiles = args.out / "tiles"
    args.out.mkdir(parents=True, exist_ok=True)
    runs = RunLog()
    record = {"shape": args.shape, "weights": args.weights, "max_tokens": args.max_tokens, "question": QUESTION,
              "image": IMAGE.name, "cpus": os.cpu_count(), "runs": []}
    out = args.out / f"tile-cache-{args.shape}-{args.weights}.json"

    with LoadTracker() as tracker:  # our processes' share of the load, as the benchmarks judge quiet runs
        if not args.no_untimed:
            print("[probe] untimed run, tile cache off (compiles)", flush=True)
            record["untimed"] = one_run(runs, "untimed", model, "off", args.max_tokens, timed=False)
        for pair in range(args.pairs):
            shutil.rmtree(tiles, ignore_errors=True)
            for kind in ("empty", "full"):
                run = one_run(runs, f"{kind} #{pair}", model, str(tiles), args.max_tokens)
                run.update(kind=kind, pair=pair, cache_after=cache_state(tiles))
                record["runs"].append(run)
                print(f"[probe] pair {pair} {kind}: {run['wall_s']:.2f} s, load {run['load']['before'][0]:.2f}",
                      flush=True)
                out.write_text(json.dumps(record, indent=1))
    summarize(record, runs, tracker, "kind", ("empty", "full"))
    record["same_tokens_full_as_empty"] = [
        next(r for r in record["runs"] if (r["pair"], r["kind"]) == (p, "empty"))["token_ids"]
        == next(r for r in record["runs"] if (r["pair"], r["kind"]) == (p, "full"))["token_ids"]
        for p in range(args.pairs)]
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["median_wall_s"]), record["same_tokens_full_as_empty"], flush=True)


if __name__ == "__main__":
    main()
