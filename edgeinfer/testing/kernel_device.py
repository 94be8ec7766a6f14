"""Where the Triton kernel tests run: a GPU, or else Triton's CPU interpreter (``TRITON_INTERPRET=1``),
which runs the same kernels in numpy on small shapes."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def kernel_marks(triton) -> list:
    """The marks of a module of kernel tests whose kernels need ``triton`` (a module, or None where
    its import failed): each skip says why."""
    return [
        pytest.mark.gpu,
        pytest.mark.skipif(triton is None, reason="needs Triton (`import triton` failed)"),
        pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET,
                           reason="needs a CUDA device, or TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter"),
    ]
