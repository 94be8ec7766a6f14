"""Benchmark workers: one engine per process, so its memory and time are its own.

Internal: a benchmark starts ``python -m edgeinfer.bench._worker TASK`` (this module of the same
package as the benchmark, :func:`~edgeinfer.bench.common.module_command`) with the task's spec
as JSON on stdin and reads one JSON object from the last line of stdout. A peer's task
imports only the peer's side (``edgeinfer.bench.peer``), never our engine or backends.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable


def _generate(kind: str) -> Callable[[dict], dict]:
    def task(data: dict) -> dict:
        from edgeinfer.bench.generate import GenerateSpec

        spec = GenerateSpec.from_json(data)
        if kind == "transformers":
            from edgeinfer.bench.peer import generate_peer

            return generate_peer(spec)
        from edgeinfer.bench.generate import run_ours

        return run_ours(spec, kind)

    return task


def _gpu(kind: str) -> Callable[[dict], dict]:
    def task(data: dict) -> dict:
        from edgeinfer.bench.gpu import GpuBenchSpec

        spec = GpuBenchSpec.from_json(data)
        if kind.startswith("transformers-"):
            from edgeinfer.bench.peer import gpu_peer

            return gpu_peer(spec, kind.removeprefix("transformers-"))
        if kind == "bandwidth":
            from edgeinfer.bench.gpu import run_bandwidth

            return run_bandwidth(spec)
        from edgeinfer.bench.gpu import run_ours

        return run_ours(spec)

    return task


def _offload_peer(data: dict) -> dict:
    from edgeinfer.bench.peer import offload_peer

    return offload_peer(data)


TASKS: dict[str, Callable[[dict], dict]] = {
    **{f"generate-{kind}": _generate(kind) for kind in ("transformers", "ours", "onnxruntime", "onnxruntime-int8",
                                                        "onnxruntime-int4", "onnxruntime-int8-vision-int8",
                                                        "onnxruntime-int4-vision-int8")},
    **{f"gpu-{kind}": _gpu(kind) for kind in ("ours", "transformers-static", "transformers-dynamic", "bandwidth")},
    "kv-offload-peer": _offload_peer,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in TASKS:
        raise SystemExit(f"usage: python -m edgeinfer.bench._worker TASK < spec.json; TASK is one of "
                         f"{', '.join(sorted(TASKS))}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    result = TASKS[argv[0]](json.loads(sys.stdin.read()))
    from edgeinfer.bench.raw import jsonable

    print(json.dumps(jsonable(result)))


if __name__ == "__main__":
    main()
