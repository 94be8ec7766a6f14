"""A decode step's products with random weights, as the GPU probes build them.

:func:`random_packed` is a packed weight of random codes with small positive scales (reads come
from memory, not from the values); :func:`fused_inputs` is x (a row, or several) and what the
fused step gives a product besides it: ``kind`` names the prologue and epilogues (``"norm"``,
``"bias"``, ``"residual"``, ``"glu"``, joined by ``+``), as in ``"norm+bias"`` for q|k|v.
:data:`QWEN2_VL_2B` names a layer's four products that way; :func:`layer_case` builds one for 28
layers' weights, and :func:`layer_calls` and :func:`right_one_row_tiles` run and check a tile as the
decode step dispatches it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch

from edgeinfer.quant.packed import PackedMatrix

# Qwen2-VL-2B's products at batch 1: (name, N, K, what the step fuses into it)
QWEN2_VL_2B = (("qkv", 2048, 1536, "norm+bias"), ("o", 1536, 1536, "residual"),
               ("gate_up", 17920, 1536, "norm+glu"), ("down", 1536, 8960, "residual"))


def random_packed(n: int, k: int, bits: int, group: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> PackedMatrix:
    """An [n, k] weight of random ``bits``-bit codes, symmetric, a scale in ``dtype`` each ``group`` columns."""
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=device)
    scales = (torch.rand(n, -(-k // group), device=device) * 0.004 + 0.001).to(dtype)
    return PackedMatrix(words, scales, None, bits, group, (n, k))


def fused_inputs(kind: str, n: int, k: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, rows: int = 1) -> tuple[torch.Tensor, dict]:
    """x [rows, k] and the keyword arguments of ``triton_decode.packed_gemv`` / ``gemv`` (or, for
    several rows, ``staged.staged_mm``) for ``kind``."""
    x = torch.randn(rows, k, device=device, dtype=dtype)
    kw = {}
    if "norm" in kind:
        kw.update(norm_weight=(torch.rand(k, device=device) + 0.5).to(dtype), eps=1e-6)
    if "bias" in kind:
        kw["bias"] = torch.randn(n, device=device, dtype=dtype)
    if "residual" in kind:
        kw["residual"] = torch.randn(rows, n, device=device, dtype=dtype)
    if "glu" in kind:
        kw["glu"] = True
    return x, kw


def layer_case(kind: str, n: int, k: int, device: torch.device, layers: int,
               group: int = 128, bits: int = 4) -> tuple[torch.Tensor, dict, list, list]:
    """One row's product of ``kind`` as the probes time it: x and what the step fuses (:func:`fused_inputs`),
    ``layers`` copies of a random ``bits``-bit [n, k] weight (:func:`random_packed`, so that reads come from
    memory) and an output row for each copy."""
    x, kw = fused_inputs(kind, n, k, device)
    weights = [random_packed(n, k, bits, group, device) for _ in range(layers)]
    outs = [torch.empty(1, n // 2 if kw.get("glu") else n, dtype=x.dtype, device=device) for _ in range(layers)]
    return x, kw, weights, outs


def layer_calls(x: torch.Tensor, weights: list, tile, outs: list, workspace, **kw) -> list:
    """The product at ``tile`` over each layer's copy of the weight into that layer's ``outs``, as the
    decode step dispatches a tile (``triton_decode.one_row_product``)."""
    from edgeinfer.backends.torch.triton_decode import one_row_product

    return [lambda w=w, o=o: one_row_product(x, w, tile, out=o, workspace=workspace, **kw)
            for w, o in zip(weights, outs)]


def right_one_row_tiles(x: torch.Tensor, w: PackedMatrix, tiles, out: torch.Tensor, workspace,
                        **kw) -> tuple[list, dict[str, str]]:
    """``triton_decode.right_tiles`` for ``tiles`` as the decode step dispatches them: the right ones,
    and each other one's first divergence by name."""
    from edgeinfer.backends.torch.triton_decode import one_row_product, right_tiles

    return right_tiles(x, w, tiles, out, lambda _x, _w, tile, out, **k: one_row_product(
        _x, _w, tile, out=out, workspace=workspace, **k), **kw)


def check_or_run(check: Callable[[torch.device], dict], run: Callable[[int], None]) -> None:
    """A GPU probe's command line: with ``--check``, ``check`` on the CPU (under Triton's interpreter),
    its findings printed and exit status 1 where any is not None; otherwise ``run`` with ``$ROUNDS``
    rounds (5)."""
    if "--check" in sys.argv:
        found = check(torch.device("cpu"))
        print(json.dumps(found, indent=1))
        sys.exit(1 if any(v is not None for v in found.values()) else 0)
    run(int(os.environ.get("ROUNDS", "5")))
