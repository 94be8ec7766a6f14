"""Shared fixtures: tiny random checkpoints built once per session from real configs."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
from PIL import Image

from edgeinfer.testing.checkpoints import make_checkpoint

torch.set_num_threads(2)

# Engines on a profile with a disk tier persist KV blocks and vision outputs under
# $XDG_CACHE_HOME; the tests (and the commands they start) use a folder of their own.
_CACHE = tempfile.mkdtemp(prefix="edgeinfer-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def edgeinfer_log_reaches_caplog(monkeypatch):
    """A daemon started in this process (uvicorn's log config) sends edgeinfer's log to its own
    handler only; every test sees it through pytest's capture again, whatever ran before it."""
    import logging

    monkeypatch.setattr(logging.getLogger("edgeinfer"), "propagate", True)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family) -> path of a tiny random checkpoint of that family (built once)."""
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = make_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (where one is longer, the shorter's length);
    None where they are the same."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB image: distinct content per seed, so vision outputs differ."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="session")
def exported_graphs(checkpoint, tmp_path_factory):
    """exported_graphs(family) -> (loaded model, folder) of the ONNX graphs ONNX Runtime runs,
    exported once per session (``family`` ``demo`` is the bundled demo model)."""
    from edgeinfer.backends.onnx.build import BuildSpec, build_engines
    from edgeinfer.demo import DEMO_MODEL_DIR
    from edgeinfer.models.loader import load_model

    root = tmp_path_factory.mktemp("exported")
    built: dict[str, tuple[object, object]] = {}

    def get(family: str):
        if family not in built:
            model = load_model(DEMO_MODEL_DIR if family == "demo" else checkpoint(family))
            result = build_engines(model, BuildSpec.custom("export"), root, progress=False)
            built[family] = (model, result.folder)
        return built[family]

    return get


@pytest.fixture(scope="module")
def hf_model():
    """hf_model(path) -> transformers' model of that checkpoint, loaded once per test module."""
    from transformers import AutoModelForImageTextToText

    loaded = {}

    def get(path):
        if path not in loaded:
            loaded[path] = AutoModelForImageTextToText.from_pretrained(path).eval()
        return loaded[path]

    return get
