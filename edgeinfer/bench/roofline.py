"""The memory-bandwidth roofline of decode: how fast a step could be if it only streamed its bytes.

The bandwidth is the best of three kernels timed on the device, each recorded: a
device-to-device copy (read + write bytes), a read-only reduction (a sum over a large
tensor) and a large matrix-vector product (the decode step's own kind of kernel). One
host-timed copy underestimates what a decode kernel reaches.

A decode step of batch ``b`` at context ``c`` reads the text weights once and the K/V of
every sequence: ``bytes = weights + b * c * kv_bytes_per_token``. The roofline rate is
``b * bandwidth / bytes`` tokens per second; the fraction is the measured rate over it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Probe:
    """One bandwidth kernel: bytes it moves per call, median seconds per call, GB/s."""

    name: str
    bytes: int
    seconds: float

    @property
    def gbs(self) -> float:
        return self.bytes / self.seconds / 1e9

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "seconds": self.seconds, "gbs": self.gbs}


def best_bandwidth_gbs(probes: list[Probe]) -> float:
    """The bandwidth the roofline uses: the fastest probe's."""
    return max(p.gbs for p in probes)


def step_bytes(weight_bytes: int, kv_bytes_per_token: int, context: float, batch: int) -> float:
    """Bytes one decode step reads: the weights once, the K/V of ``batch`` sequences of ``context`` tokens."""
    return weight_bytes + batch * context * kv_bytes_per_token


def roofline_tok_s(bandwidth_gbs: float, weight_bytes: int, kv_bytes_per_token: int, context: float,
                   batch: int) -> float:
    """Tokens per second a decode step streaming at ``bandwidth_gbs`` would give."""
    return batch * bandwidth_gbs * 1e9 / step_bytes(weight_bytes, kv_bytes_per_token, context, batch)


def _device_seconds(fn: Callable[[], object], device: str, calls: int = 10, warmup: int = 3) -> float:
    """Median seconds per call of ``fn``: CUDA events on a GPU, a wall clock on a CPU."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    times = []
    cuda = device.startswith("cuda")
    for _ in range(calls):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_probe(device: str, size: int) -> Probe:
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return Probe("copy", 2 * size, _device_seconds(lambda: dst.copy_(src), device))


def _sum_probe(device: str, size: int) -> Probe:
    import torch

    values = torch.ones(size // 4, dtype=torch.float32, device=device)
    return Probe("sum", size, _device_seconds(lambda: values.sum(), device))


def _gemv_probe(device: str, size: int, dtype: str) -> Probe:
    import torch

    torch_dtype = getattr(torch, dtype)
    elem = torch.empty((), dtype=torch_dtype).element_size()
    cols = 8192
    weight = torch.randn(size // (cols * elem), cols, dtype=torch_dtype, device=device)
    x = torch.randn(1, cols, dtype=torch_dtype, device=device)
    return Probe("gemv", weight.numel() * elem, _device_seconds(lambda: torch.nn.functional.linear(x, weight), device))


def measure_probes(device: str, mib: int = 1024, dtype: str = "bfloat16") -> list[Probe]:
    """Time the three bandwidth kernels over ``mib`` MiB buffers on ``device`` (one at a time)."""
    size = mib * 2**20
    probes = [_copy_probe(device, size), _sum_probe(device, size), _gemv_probe(device, size, dtype)]
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return probes


def roofline(rates: dict[int, float], bandwidth_gbs: float, weight_bytes: int, kv_bytes_per_token: int,
             context: float) -> dict[int, dict[str, float]]:
    """For each batch size's measured decode rate: the roofline rate and the fraction reached."""
    out = {}
    for batch, measured in rates.items():
        roof = roofline_tok_s(bandwidth_gbs, weight_bytes, kv_bytes_per_token, context, batch)
        out[batch] = {"roofline_tok_s": roof, "fraction": measured / roof}
    return out
