"""Shared fixtures: tiny random checkpoints built once per session from real configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from edgeinfer.testing.checkpoints import make_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family) -> path of a tiny random checkpoint of that family (built once)."""
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = make_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB image: distinct content per seed, so vision outputs differ."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
