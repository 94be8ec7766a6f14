"""Diagnostic probe (not a benchmark): how long the fused batch-1 step's tiles take to compile, one
after another as their first launches compiled them, and on a pool of threads
(``kernels.compile_ahead``). Without a GPU, the compiles alone, for Orin (sm_87) or Hopper (sm_90);
with ``--gpu``, whole ``edgeinfer run`` processes on a GPU.

    python scripts/probe_compile_ahead.py --out DIR [--pairs 3] [--arch 87] [--workers N] [--staged | --integer-dot]
        [--bits 8]
    python scripts/probe_compile_ahead.py --gpu --out DIR [--pairs 2] [--cache /tmp/cache]

``--staged``: instead of one after another against on threads, on threads without the staged kernel's
tiles (``staged.tiles_that_fit`` of the four 4-bit products, what the batch-1 tuner adds on a GPU
that runs them unless ``$EDGEINFER_STAGED_PRODUCTS=0``) against on threads with them: what they add to a
first load's compiles. Writes ``DIR/compile-staged-smARCH.json``.

``--integer-dot``: the same for ``packed_gemv``'s integer-dot tiles (what ``triton_decode._candidates`` adds for
the packed products unless ``$EDGEINFER_INTEGER_DOT=0``). Writes ``DIR/compile-integer-dot-smARCH.json``.

``--bits 8``: the layers' products in 8 bits (groups of 128), as a W8A16 checkpoint has them, rather than 4; the
file's name ends in ``-w8``. ``--head-bits 4``: the head 4-bit in groups of 128 (``--lm-head int4``) rather than
int8 a row; the file's name ends in ``-h4``.

``--gpu``: the benchmark's 4-bit checkpoint of ``--shape`` (Qwen2-VL-2B; built once under ``--cache``,
as ``probe_tile_cache.py`` builds it), one untimed ``edgeinfer run`` first (torch.compile's cache
and the checkpoint's digests then warm for every run alike), then ``--pairs`` times a run with
``$EDGEINFER_COMPILE_AHEAD`` on and one with it off (``0``), each with Triton's cache emptied and
the tile cache off, so each compiles and times every tile: its wall time, the load's parts
(``timings.load``) and tokens. Writes ``DIR/compile-ahead-gpu.json``.

On a GPU the tuner compiles every candidate tile of every product the first time a checkpoint
loads (the tile cache then keeps the choices, and Triton's own cache the binaries). This probe
compiles the same kernels with the same arguments — the products of a Qwen2-VL-2B layer in 4 bits
(groups of 128; ``--bits 8``: 8) and its 8-bit head (``--head-bits 4``: 4-bit), as ``FusedDecode._tune_alone``
calls them — through the wrappers' ``warmup`` path under a compile-only driver
(:mod:`edgeinfer.testing.triton_compile`).
Each run is a fresh process with an empty Triton cache; the two ways alternate, ``--pairs`` times.
The raw file records each run's seconds, kernels, the load before and after it, and our own share
of that load, as the CPU benchmarks judge a quiet run. Launch options that depend on the device
(dependent launches on Hopper) are those of a CPU tensor: off."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeinfer.bench.quiet import LoadTracker, RunLog, judge  # noqa: E402
from edgeinfer.quant.launching import INTEGER_DOT_ENV  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, VOCAB = 1536, 8960, 2048, 151936  # Qwen2-VL-2B's decoder


def products(bits: int = 4, head_bits: int = 8):
    """(weight, what the product fuses) for q|k|v, o, gate|up and down in ``bits`` (groups of 128) and the
    head in ``head_bits`` (8: a scale a row; 4: groups of 128)."""
    import torch

    from edgeinfer.quant.packed import PackedMatrix

    def packed(n, k, bits, group):
        return PackedMatrix(torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), dtype=torch.int32),
                            torch.rand(n, -(-k // group), dtype=torch.bfloat16), None, bits, group, (n, k))

    def row(n):
        return torch.randn(1, n, dtype=torch.bfloat16)

    norm = {"norm_weight": row(HIDDEN)[0], "eps": 1e-6}
    return {"qkv": (packed(QKV, HIDDEN, bits, 128), {"bias": row(QKV)[0], **norm}),
            "o": (packed(HIDDEN, HIDDEN, bits, 128), {"residual": row(HIDDEN)}),
            "gate_up": (packed(2 * INTERMEDIATE, HIDDEN, bits, 128), {"glu": True, **norm}),
            "down": (packed(HIDDEN, INTERMEDIATE, bits, 128), {"residual": row(HIDDEN)}),
            "lm_head": (packed(VOCAB, HIDDEN, head_bits, HIDDEN if head_bits == 8 else 128), norm)}


def child(way: str, arch: int, workers: int, bits: int = 4, head_bits: int = 8) -> None:
    """One run: compile every product's candidate tiles ``way`` (serial, ahead, or ahead with the staged
    kernel's tiles or the integer-dot ones too: ahead+staged, ahead+idot); print the figures."""
    import torch
    from triton.backends.compiler import GPUTarget

    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.quant import kernels, staged
    from edgeinfer.testing.triton_compile import binaries, compile_only

    with_staged = way == "ahead+staged"
    calls = []
    jitted = [triton_decode._packed_gemv_kernel] + ([staged._staged_gemv_kernel] if with_staged else [])
    for w, kw in products(bits, head_bits).values():
        x = torch.randn(1, w.shape[1], dtype=torch.bfloat16)
        tiles = triton_decode._candidates(w, torch.bfloat16, bool(kw.get("glu")))
        calls += [lambda c=c, w=w, x=x, kw=kw: triton_decode.packed_gemv(x, w, c, warmup=True, **kw)
                  for c in tiles if isinstance(c, triton_decode.PackedGemvConfig)]
        if with_staged:  # staged.candidates on a GPU that runs the kernel (this CPU does not)
            calls += [lambda c=c, w=w, x=x, kw=kw: staged.staged_gemv(x, w, c, warmup=True, **kw)
                      for c in staged.tiles_that_fit(w, torch.bfloat16, bool(kw.get("glu")))]
    with compile_only(GPUTarget("cuda", arch, 32), jitted):
        started = time.perf_counter()
        if way.startswith("ahead"):
            kernels.compile_ahead(calls, workers=workers)
        else:
            for call in calls:
                call()
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "kernels": binaries(jitted), "calls": len(calls)}))


def on_gpu(args) -> None:
    """``edgeinfer run`` with compile_ahead on and off, Triton's cache empty before each run."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from probe_tile_cache import one_run, summarize

    from edgeinfer.bench.common import bench_checkpoint
    from edgeinfer.bench.weights import format_checkpoint
    from edgeinfer.quant.kernels import COMPILE_AHEAD_ENV

    model = format_checkpoint(bench_checkpoint(args.shape, args.cache), "w4a16-h8", args.cache, args.group_size,
                              "bfloat16")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "compile-ahead-gpu.json"
    runs = RunLog()
    record = {"shape": args.shape, "weights": "w4a16-h8", "group_size": args.group_size, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
              "runs": []}
    with LoadTracker() as tracker:
        with tempfile.TemporaryDirectory() as cache:
            record["untimed"] = one_run(runs, "untimed", model, "off", args.max_tokens, timed=False,
                                        env={"TRITON_CACHE_DIR": cache})
        for pair in range(args.pairs):
            for way, flag in (("ahead", "1"), ("serial", "0")):
                with tempfile.TemporaryDirectory() as cache:
                    run = one_run(runs, f"{way} #{pair}", model, "off", args.max_tokens,
                                  env={"TRITON_CACHE_DIR": cache, COMPILE_AHEAD_ENV: flag})
                run.update(way=way, pair=pair)
                record["runs"].append(run)
                print(f"[probe] pair {pair} {way}: {run['wall_s']:.1f} s, load {run['timings'].get('load')}",
                      flush=True)
                out.write_text(json.dumps(record, indent=1))
    summarize(record, runs, tracker, "way", ("ahead", "serial"))
    record["same_tokens"] = len({tuple(r["token_ids"]) for r in record["runs"]}) == 1
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["median_wall_s"]), "same tokens" if record["same_tokens"] else "TOKENS DIFFER", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--arch", type=int, default=87, help="87: Orin; 90: Hopper")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--gpu", action="store_true", help="whole edgeinfer run processes on this machine's GPU")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/cache"), help="--gpu: where the checkpoints are built")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--shape", default="qwen2-vl-2b", help="--gpu: the benchmark's checkpoint shape")
    parser.add_argument("--group-size", type=int, default=128, help="--gpu: the 4-bit checkpoint's groups")
    parser.add_argument("--staged", action="store_true",
                        help="on threads, without the staged kernel's tiles against with them")
    parser.add_argument("--integer-dot", action="store_true",
                        help="on threads, without packed_gemv's integer-dot tiles against with them")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4,
                        help="without --gpu: the layers' codes (groups of 128)")
    parser.add_argument("--head-bits", type=int, choices=(4, 8), default=8,
                        help="without --gpu: the head's codes (8: a scale a row; 4: groups of 128)")
    parser.add_argument("--child", choices=("serial", "ahead", "ahead+staged", "ahead+idot"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.arch, args.workers, args.bits, args.head_bits)
        return
    if args.gpu:
        on_gpu(args)
        return

    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    extra = "staged" if args.staged else "integer-dot" if args.integer_dot else None
    ways = ("ahead", f"ahead+{'idot' if args.integer_dot else 'staged'}") if extra else ("serial", "ahead")
    suffix = ("-w8" if args.bits == 8 else "") + ("-h4" if args.head_bits == 4 else "")
    out = args.out / f"compile-{extra or 'ahead'}-sm{args.arch}{suffix}.json"
    runs = RunLog()
    record = {"arch": args.arch, "workers": args.workers, "cpus": os.cpu_count(), "triton": triton.__version__,
              "shape": f"qwen2-vl-2b w{args.bits}a16 g128, {args.head_bits}-bit head"
                       + (" g128" if args.head_bits == 4 else ""), "ways": ways, "runs": []}
    with LoadTracker() as tracker:  # our processes' share of the load, as the benchmarks judge quiet runs
        for pair in range(args.pairs):
            for way in ways:
                with tempfile.TemporaryDirectory() as cache, runs.run(f"{way} #{pair}") as run:
                    env = {**os.environ, "TRITON_CACHE_DIR": cache, "TRITON_DEFAULT_FP_FUSION": "1"}
                    if args.integer_dot:  # the packed tiles the tuner times: without those tiles, then with them
                        env[INTEGER_DOT_ENV] = "1" if way == "ahead+idot" else "0"
                    done = subprocess.run([sys.executable, __file__, "--child", way, "--arch", str(args.arch),
                                           "--workers", str(args.workers), "--bits", str(args.bits),
                                           "--head-bits", str(args.head_bits),
                                           "--out", str(args.out)],
                                          capture_output=True, text=True, env=env, cwd=ROOT)
                    if done.returncode:
                        raise RuntimeError(f"the {way} run exited with {done.returncode}:\n{done.stderr[-4000:]}")
                    run.update(way=way, pair=pair, **json.loads(done.stdout.strip().splitlines()[-1]))
                record["runs"].append(run)
                print(f"[probe] pair {pair} {way}: {run['seconds']:.1f} s, {run['kernels']} kernels, "
                      f"load {run['load']['before'][0]:.2f}", flush=True)
                out.write_text(json.dumps(record, indent=1))
    record["quiet"] = judge(runs.records, tracker.share_at).to_dict()
    record["median_s"] = {way: statistics.median(r["seconds"] for r in record["runs"] if r["way"] == way)
                          for way in ways}
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["median_s"]), "quiet" if record["quiet"]["publishable"] else "NOT quiet", flush=True)


if __name__ == "__main__":
    main()
