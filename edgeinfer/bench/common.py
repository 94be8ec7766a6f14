"""What every benchmark shares: pictures, a device barrier, a token clock, the environment.

Nothing here imports the engine or a backend: the peer's worker process uses this module
too, and it must hold nothing of ours.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Module prefixes of our runtime; a peer's worker process must have none of them loaded.
OUR_RUNTIME = ("edgeinfer.engine", "edgeinfer.backends", "edgeinfer.models", "edgeinfer.kv")


def bench_image(size: int | tuple[int, int], seed: int = 0):
    """A random RGB picture, ``size`` pixels square or ``(width, height)``; the same for a seed."""
    import numpy as np
    from PIL import Image

    w, h = (size, size) if isinstance(size, int) else size
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def sync(device: str) -> None:
    """Wait for the device's queued work, so a wall clock around it measures the work."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def loaded_runtime_modules(modules: dict[str, Any]) -> list[str]:
    """The modules of ``modules`` (``sys.modules``) that belong to our runtime."""
    return sorted(name for name in modules if name.startswith(OUR_RUNTIME))


def require_nothing_of_ours() -> None:
    """Stop a peer's worker that has any of our runtime loaded: its memory and time would include ours."""
    import sys

    loaded = loaded_runtime_modules(sys.modules)
    if loaded:
        raise RuntimeError(f"the peer's worker must hold nothing of edgeinfer's runtime; loaded: {', '.join(loaded)}")


class TokenClock:
    """A transformers streamer that timestamps each generated token (the first call carries the prompt).

    ``generate()`` hands ``put`` the tokens already copied to the host, so a stamp is when that
    step's tokens reached the host, on a GPU too. Where transformers defers that copy by a step
    (its ``DeferredStopCheck``, on Apple's GPUs), the stamps are a step late: a span from the first
    stamp to the call's end is then a step short, which favours the peer.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_mb(device: str) -> float:
    """Peak device memory allocated by torch on a GPU, peak RSS on a CPU, in MB."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


def git_state(root: Path | None = None) -> dict[str, Any]:
    """The commit the benchmark ran from and whether the tree had changes (None outside a checkout)."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


# The vector and matrix instructions that change which CPU kernels ONNX Runtime and torch run
# (int8 products with or without VNNI, bf16 and int8 on AMX): two runs compare only where they match.
CPU_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and which of :data:`CPU_FEATURES` it has, from Linux's ``/proc/cpuinfo``
    (its first processor); elsewhere the platform's processor string and no features."""
    try:
        fields = dict(line.split(":", 1) for line in cpuinfo.read_text().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return {"cpu": platform.processor() or platform.machine(), "cpu_features": None}
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cpu_features": [f for f in CPU_FEATURES if f in flags]}


def switches(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ``EDGEINFER_*`` variables set for this run (kernels behind a switch, the tile cache):
    two runs of one tree differ by these."""
    return {name: value for name, value in sorted(environ.items()) if name.startswith("EDGEINFER_")}


def environment(device: str, threads: int | None = None) -> dict[str, Any]:
    """Versions and hardware of this run, and its ``EDGEINFER_*`` switches, as the raw file records them."""
    import torch
    import transformers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "machine": platform.machine(),
                           **cpu_identity(), "cores": os.cpu_count(), "threads": threads, "device": device,
                           "switches": switches()}
    try:
        import onnxruntime

        env["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


# Where the benchmarks build their checkpoints unless told (``--cache``, or this variable).
DEFAULT_CACHE = Path.home() / ".cache" / "edgeinfer" / "bench"
CACHE_ENV = "EDGEINFER_BENCH_CACHE"
# Checkpoint shapes the benchmarks build (random weights, published shapes): name -> family.
SHAPES = {"smolvlm-256m": "smolvlm", "qwen2-vl-2b": "qwen2_vl", "qwen3-vl-2b": "qwen3_vl", "gemma-3-4b": "gemma3"}


def bench_checkpoint(shape: str, cache: Path) -> Path:
    """The random checkpoint of ``shape`` under ``cache``, built once (into a temporary folder
    renamed at the end, so an interrupted build is never taken for a finished one)."""
    import shutil
    import tempfile

    from edgeinfer.testing.checkpoints import make_checkpoint

    if shape not in SHAPES:
        raise ValueError(f"unknown checkpoint shape {shape!r}; choose from {', '.join(SHAPES)}")
    path = cache / shape
    if (path / "config.json").is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=cache))
    try:
        make_checkpoint(SHAPES[shape], scratch, size=shape)
        scratch.rename(path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` run by the ``edgeinfer`` this process imported. ``-m`` puts the
    working directory first on the new interpreter's path, so from a source tree of another
    version it would run that tree's code: here the path's first entry is this package's
    directory instead."""
    root = str(Path(__file__).resolve().parents[2])
    code = (f"import runpy, sys; sys.path[0] = {root!r}; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, *args]


def call_worker(task: str, payload: dict[str, Any], env: dict[str, str] | None = None,
                timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``task`` in a fresh process (``python -m edgeinfer.bench._worker`` of this package,
    :func:`module_command`, which imports nothing of ours beyond the task's side); its JSON answer,
    or ``RuntimeError`` with its stderr's tail, or saying that it did not finish within
    ``timeout_s`` (then it is killed)."""
    try:
        done = subprocess.run(module_command("edgeinfer.bench._worker", task), input=json.dumps(payload),
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise RuntimeError(f"worker {task} did not finish within {timeout_s:g} s (killed):\n{tail}") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"worker {task} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])
