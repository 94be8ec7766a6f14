"""What every benchmark shares: the synthetic picture and a device barrier."""

from __future__ import annotations


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
