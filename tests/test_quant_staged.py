"""The batch-1 4-bit product whose words wait in shared memory (``edgeinfer.quant.staged``).

Which products and tiles it takes, and that the tuner times it only where it is turned on, are
checked on any machine; its outputs against torch's need a GPU (Gluon kernels do not run in
Triton's CPU interpreter), and its compiled structure is checked without one in
tests/test_kernels_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from edgeinfer.quant import staged
from edgeinfer.quant.kernels import compile_ahead
from edgeinfer.quant.launching import (
    INTEGER_DOT_ENV,
    ROWS_IN_STEP_ENV,
    STAGED_ENV,
    STAGED_MMA_ENV,
    PackedGeometry,
    SplitWorkspace,
)
from edgeinfer.quant.packed import PackedMatrix
from edgeinfer.quant.staged import StagedGemvConfig, unfit
from edgeinfer.testing.products import random_packed


def packed(n: int, k: int, bits: int = 4, group: int = 128, dtype=torch.bfloat16, device="cpu") -> PackedMatrix:
    return random_packed(n, k, bits, group, torch.device(device), dtype)


def test_a_product_outside_the_kernel_is_named_with_its_limit():
    fits = packed(17920, 1536)
    assert unfit(fits, torch.bfloat16, True, StagedGemvConfig(1)) is None
    assert unfit(packed(1536, 8960), torch.bfloat16, False, StagedGemvConfig(4, 5)) is None
    w = fits
    misaligned = torch.zeros(64 * 192 + 1, dtype=torch.int32)[1:].view(64, 192)  # 4 bytes past a 16-byte line
    cases = [
        (packed(64, 1536, bits=8, group=1536), torch.bfloat16, False, StagedGemvConfig(1), "8-bit codes"),
        (w, torch.float32, True, StagedGemvConfig(1), "torch.float32 activations"),
        (packed(64, 1536, dtype=torch.float16), torch.bfloat16, False, StagedGemvConfig(1), "torch.float16 scales"),
        (packed(64, 1536, group=64), torch.bfloat16, False, StagedGemvConfig(1), "groups of 64 over 1536"),
        (packed(64, 1000, group=1000), torch.bfloat16, False, StagedGemvConfig(1), "over 1000 columns"),
        (PackedMatrix(misaligned, w.scales[:64], None, 4, 128, (64, 1536)), torch.bfloat16, False,
         StagedGemvConfig(1), "16-byte aligned"),
        (w, torch.bfloat16, True, StagedGemvConfig(1, 5), "12 chunks of 128 columns do not split 5 ways"),
        (packed(64, 128 * 34), torch.bfloat16, False, StagedGemvConfig(1), "34 chunks a program (at most 16)"),
        (packed(40, 1536), torch.bfloat16, False, StagedGemvConfig(1), "40 rows in tiles of 16"),
        (packed(24, 1536), torch.bfloat16, True, StagedGemvConfig(1), "12 outputs in tiles of 8 (glu)"),
        (w, torch.bfloat16, True, StagedGemvConfig(1, 2, early=7), "7 chunks copied early of 6 a program"),
        (w, torch.bfloat16, True, StagedGemvConfig(1, 2, early=0), "0 chunks copied early of 6 a program"),
        (packed(64, 2048), torch.bfloat16, False, StagedGemvConfig(4),
         f"{16 * 4 * 16 * 64 + 16 * 256} bytes of shared memory a program (at most 65536)"),
    ]
    for w, dtype, glu, config, reason in cases:
        got = unfit(w, dtype, glu, config)
        assert got is not None and reason in got, (reason, got)


def test_a_product_it_cannot_take_is_refused_before_anything_launches():
    w = packed(64, 1536)
    x = torch.randn(1, 1536, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="staged_gemv reads one row, got 2"):
        staged.staged_gemv(torch.randn(2, 1536, dtype=torch.bfloat16), w, StagedGemvConfig(1))
    with pytest.raises(ValueError, match="cannot take this product: .*(not a CUDA device|Gluon is not installed)"):
        staged.staged_gemv(x, w, StagedGemvConfig(1))
    if staged.gluon is not None:  # a compile alone skips the device check, not the product's
        with pytest.raises(ValueError, match="cannot take this product: 12 chunks of 128 columns do not split 5 ways"):
            staged.staged_gemv(x, w, StagedGemvConfig(1, 5), warmup=True)


def test_its_tiles_are_timed_unless_turned_off_and_on_a_gpu_that_runs_it(monkeypatch):
    gate_up, down = packed(17920, 1536), packed(1536, 8960)
    monkeypatch.setenv(STAGED_ENV, "0")
    monkeypatch.setattr(staged, "unavailable", lambda device: None)  # as on a GPU that can run it
    assert not staged.enabled() and staged.candidates(gate_up, torch.bfloat16, True) == []
    monkeypatch.undo()
    monkeypatch.delenv(STAGED_ENV, raising=False)  # on by default
    assert staged.enabled()
    assert staged.unavailable(torch.device("cpu")) in ("not a CUDA device", "Triton's Gluon is not installed")
    assert staged.candidates(gate_up, torch.bfloat16, True) == []  # these weights are on the CPU
    monkeypatch.setattr(staged, "unavailable", lambda device: None)  # as on a GPU that can run it
    got = staged.candidates(gate_up, torch.bfloat16, True)
    assert [(c.warps, c.split) for c in got] == [(w, s) for w in (1, 2, 4) for s in (1, 2, 3)]
    got = staged.candidates(down, torch.bfloat16, False)  # 70 chunks: 5, 7 and 10 splits are the fewest of ≤ 16
    assert [(c.warps, c.split) for c in got] == [(w, s) for w in (1, 2, 4) for s in (5, 7, 10)]
    assert all(unfit(down, torch.bfloat16, False, c) is None for c in got)
    assert staged.candidates(packed(64, 1536, bits=8, group=1536), torch.bfloat16, False) == []


def test_the_step_asks_for_its_tiles_after_packed_gemv_s(monkeypatch):
    """packed_gemv's float tiles first, then its integer-dot tiles (16-bit activations, 4-bit or 8-bit codes,
    unless switched off; two more for 8-bit codes), then the staged kernel's."""
    from edgeinfer.backends.torch import triton_decode

    w = packed(17920, 1536)
    monkeypatch.setenv(STAGED_ENV, "1")
    monkeypatch.delenv(INTEGER_DOT_ENV, raising=False)  # on by default
    monkeypatch.setattr(staged, "unavailable", lambda device: None)
    floats, integers = triton_decode.PACKED_GEMV_CANDIDATES, triton_decode.INTEGER_DOT_CANDIDATES
    assert not any(t.idot for t in floats) and integers and all(t.idot for t in integers)
    for dtype in (torch.bfloat16, torch.float16):
        assert triton_decode._candidates(w, dtype, True) == floats + integers + tuple(staged.candidates(w, dtype, True))
    assert triton_decode._candidates(w, torch.float32, True) == floats + tuple(staged.candidates(w, torch.float32, True))
    monkeypatch.setenv(INTEGER_DOT_ENV, "0")
    staged_tiles = tuple(staged.candidates(w, torch.bfloat16, True))
    assert triton_decode._candidates(w, torch.bfloat16, True) == floats + staged_tiles
    assert triton_decode._candidates(w) == floats  # no dtype: packed_gemv's float tiles alone
    monkeypatch.delenv(INTEGER_DOT_ENV)
    # 8-bit codes (which the staged kernel does not take): the integer-dot tiles with one scale a row, as the
    # int8 head has, and with groups, as W8A16's layers have, and two more that only 8-bit gate|up was fastest on
    eights = triton_decode.INTEGER_DOT_8BIT_CANDIDATES
    assert eights and all(t.idot for t in eights) and not set(eights) & set(integers)
    assert not set(eights) & set(triton_decode._candidates(w, torch.bfloat16, True))  # not for 4-bit codes
    for w8 in (packed(4096, 1536, bits=8, group=1536), packed(4096, 1536, bits=8, group=128)):
        for dtype in (torch.bfloat16, torch.float16):
            assert triton_decode._candidates(w8, dtype, False) == floats + integers + eights
        assert triton_decode._candidates(w8, torch.float32, False) == floats
        monkeypatch.setenv(INTEGER_DOT_ENV, "0")
        assert triton_decode._candidates(w8, torch.bfloat16, False) == floats
        monkeypatch.delenv(INTEGER_DOT_ENV)
    assert triton_decode._config_name(triton_decode.PackedGemvConfig(8, 2048, 4, idot=True)) == "8x2048/4w/split1/idot"
    assert triton_decode._config_name(StagedGemvConfig(2, 7)) == "staged/2w/split7"
    assert triton_decode._config_name(StagedGemvConfig(2, 7, early=3)) == "staged/2w/split7/early3"


def test_the_tensor_core_kernel_s_staged_tiles_are_timed_only_where_turned_on(monkeypatch):
    """At 2 to 16 rows the tensor-core kernel's staged tiles (every step's words and x in shared
    memory at once) join its candidates only with their own switch, not the one-row staged tiles'
    (on by default); each leaves every split the same steps, at least two, within ``STAGED_BYTES``
    of shared memory."""
    from edgeinfer.quant import kernels

    gate_up = PackedGeometry(17920, 1536, 4, 12, 128)
    down = PackedGeometry(1536, 8960, 4, 70, 128)
    monkeypatch.delenv(STAGED_MMA_ENV, raising=False)
    monkeypatch.setenv(STAGED_ENV, "1")
    assert not any(c.staged for rows in (8, 16) for c in kernels.mma_candidates(gate_up, rows))
    monkeypatch.setenv(STAGED_MMA_ENV, "1")
    for layout, rows, want in ((gate_up, 16, [(64, 2), (64, 3), (128, 2), (128, 3)]),
                               (gate_up, 8, [(64, 1), (64, 2), (128, 2), (128, 3)]),
                               (down, 16, [(64, 10), (64, 14), (128, 10), (128, 14)])):
        tiles = [c for c in kernels.mma_candidates(layout, rows) if c.staged]
        assert tiles == kernels.staged_mma_candidates(layout, rows)
        assert [(c.bn, c.split) for c in tiles] == want, (layout, rows)
        for c in tiles:
            steps = layout.k // c.bk
            assert c.mma and c.x_shared and c.wide and steps % c.split == 0 and steps // c.split >= 2
            assert kernels.staged_bytes(layout.k, c.bn, c.bk, c.split, rows) <= kernels.STAGED_BYTES
    assert kernels._tile_name(tiles[0]).endswith("/x-shared/wide/staged")
    # groups shorter than a step of 128 columns: none
    assert kernels.staged_mma_candidates(PackedGeometry(256, 1024, 4, 16, 64), 16) == []


def _gpu_skip() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is false)"
    return staged.unavailable(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"the staged kernel cannot run here: {_gpu_skip()}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zeros", [False, True], ids=["symmetric", "zeros"])
@pytest.mark.parametrize("fused", ["plain", "norm bias", "norm glu", "residual"])
def test_the_staged_product_is_torch_s_within_the_step_s_check(dtype, zeros, fused):
    """Every tile, whole and split, with all its copies out before x is read or only the first
    chunk's, gives what the fused step's check takes (torch's product, rounded where the eager
    layer rounds, at both ends of N and between: a code from the wrong nibble, a chunk's x or scale
    from another chunk, or a gate paired with another output's up row moves whole outputs), for a
    gate|up-like, a down-like (70 chunks) and a q|k|v-like product, with and without zero points;
    every split product leaves its arrival counts at zero."""
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(3)
    dev = torch.device("cuda")
    shapes = {"plain": (512, 1536), "norm bias": (2048, 1536), "norm glu": (1024, 1536), "residual": (256, 8960)}
    n, k = shapes[fused]
    groups = k // 128
    w = packed(n, k, dtype=dtype, device="cuda")
    if zeros:
        w = PackedMatrix(w.codes, w.scales, torch.randint(0, 16, (n, groups), device=dev).to(dtype), 4, 128, (n, k))
    x = torch.randn(1, k, device=dev, dtype=dtype)
    kw = {}
    if "norm" in fused:
        kw.update(norm_weight=torch.empty(k, device=dev, dtype=dtype).uniform_(0.5, 1.5), eps=1e-6)
    if "bias" in fused or "glu" in fused:
        kw["bias"] = torch.randn(n, device=dev, dtype=dtype)
    if "glu" in fused:
        kw["glu"] = True
    if fused == "residual":
        kw["residual"] = torch.randn(1, n, device=dev, dtype=dtype)
    glu = kw.get("glu", False)
    tiles = [StagedGemvConfig(nw, s) for nw in (1, 2, 4) for s in (1, 2, 3, 5, 7, 10)
             if groups % s == 0 and unfit(w, dtype, glu, StagedGemvConfig(nw, s)) is None]
    assert len(tiles) >= 3 and any(t.split > 1 for t in tiles)
    tiles += [StagedGemvConfig(t.warps, t.split, early=1) for t in tiles[:2]]  # the rest copied after x's loads
    space = SplitWorkspace(dev)
    out = torch.empty(1, n // 2 if glu else n, device=dev, dtype=dtype)

    def run(x, w, tile, **kw):
        return staged.staged_gemv(x, w, tile, workspace=space, **kw)

    compile_ahead(lambda t=t: run(x, w, t, out=out, warmup=True, **kw) for t in tiles)  # on every core, as the tuner
    right, wrong = triton_decode.right_tiles(x, w, tiles, out, run, **kw)
    assert right == tiles and wrong == {}, wrong
    torch.cuda.synchronize()
    assert int(space.arrivals.abs().sum()) == 0, "a split product left an arrival count behind"


def _bf16_w4_tokens(tmp_path_factory, monkeypatch, together: bool):
    """A function giving the tokens and kernel report of the test requests on a tiny checkpoint whose
    products the staged kernel takes (``tiny-k256``, quantized to 4 bits in bf16 so that its scales
    are bf16 too), one at a time or ``together``, each call a fresh engine with the tile cache off."""
    from edgeinfer.testing.checkpoints import make_checkpoint
    from edgeinfer.testing.quantized import quantize_compressed_tensors
    from edgeinfer.tile_cache import TILE_CACHE_ENV
    from tests.test_quant_packed import cuda_tokens

    src = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("k256"), size="tiny-k256")
    path = quantize_compressed_tensors(src, tmp_path_factory.mktemp("w4"), bits=4, group_size=128, dtype=torch.bfloat16)
    monkeypatch.setenv(TILE_CACHE_ENV, "off")

    def tokens():
        out, engine = cuda_tokens(path, together=together, dtype="bfloat16")
        return out, engine.decoder_engine.kernel_report
    return tokens


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"the staged kernel cannot run here: {_gpu_skip()}")
def test_a_decode_on_staged_products_is_reported_against_packed_gemv_s(tmp_path_factory, monkeypatch):
    """The whole batch-1 step, every product on a staged tile (the switch on, the tuner offered only
    those), in CUDA graphs with dependent launches: the step takes them (its report names them, and
    none failed the check against torch), and its tokens against the same step on ``packed_gemv``'s
    tiles are reported by first divergence. The two sum in other orders in bf16, so a random
    checkpoint's tokens may part late; the first must agree."""
    from edgeinfer.backends.torch import triton_decode
    from tests.conftest import first_divergence

    tokens = _bf16_w4_tokens(tmp_path_factory, monkeypatch, together=False)

    monkeypatch.setenv(STAGED_ENV, "0")
    plain, plain_report = tokens()
    monkeypatch.delenv(STAGED_ENV)  # on by default
    every = triton_decode._candidates
    monkeypatch.setattr(triton_decode, "_candidates", lambda w, dtype=None, glu=False: tuple(
        c for c in every(w, dtype, glu) if isinstance(c, StagedGemvConfig)) or every(w, dtype, glu))
    on_staged, report = tokens()
    products = ("qkv", "o", "gate_up", "down")
    assert plain_report["fused"] and report["fused"], (plain_report, report)
    assert all(not plain_report["products"][p]["config"].startswith("staged/") for p in products)
    assert all(report["products"][p]["config"].startswith("staged/") for p in products), report["products"]
    assert report["fused_replays"] > 0 and not [p for p, r in report["products"].items() if "wrong_outputs" in r]
    positions = [first_divergence(x, y) for x, y in zip(plain, on_staged)]
    print(f"first divergence staged vs packed_gemv per request (None = identical): {positions}")
    assert all(p is None or p > 0 for p in positions)


def test_several_rows_are_refused_outside_two_to_sixteen_before_anything_launches():
    w = packed(64, 1536)
    for rows in (1, 17):
        with pytest.raises(ValueError, match=f"staged_mm reads 2 to 16 rows, got {rows}"):
            staged.staged_mm(torch.randn(rows, 1536, dtype=torch.bfloat16), w, StagedGemvConfig(1))
    with pytest.raises(ValueError, match="cannot take this product: .*(not a CUDA device|Gluon is not installed)"):
        staged.staged_mm(torch.randn(4, 1536, dtype=torch.bfloat16), w, StagedGemvConfig(1))


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"the staged kernel cannot run here: {_gpu_skip()}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zeros", [False, True], ids=["symmetric", "zeros"])
def test_several_rows_are_torch_s_product_within_the_tuner_s_check(dtype, zeros):
    """``staged_mm`` at 3 to 16 rows (one MMA of 8 columns, or two), whole and split, gives torch's
    product of the dequantized weight within the tuner's check (``kernels.divergence``, at both
    ends of N and between, every row of x: a row of x paired with another's column, a chunk's x
    from another chunk or a code from the wrong nibble moves whole outputs), for a q|k|v-like and a
    down-like product (70 chunks, split); every split product leaves its arrival counts at zero."""
    from edgeinfer.quant.kernels import checked_outputs, checked_tiles, reference_outputs

    torch.manual_seed(5)
    dev = torch.device("cuda")
    space = SplitWorkspace(dev)
    for n, k in ((512, 1536), (256, 8960)):
        groups = k // 128
        w = packed(n, k, dtype=dtype, device="cuda")
        if zeros:
            w = PackedMatrix(w.codes, w.scales, torch.randint(0, 16, (n, groups), device=dev).to(dtype), 4, 128, (n, k))
        tiles = [StagedGemvConfig(nw, s) for nw in (1, 2, 4) for s in (1, 2, 3, 5, 7, 10)
                 if groups % s == 0 and unfit(w, dtype, False, StagedGemvConfig(nw, s)) is None][:3]
        assert tiles
        outputs = checked_outputs(n)
        for rows in (3, 8, 9, 16):  # one MMA of 8 columns, part used and whole; two, part used and whole
            x = torch.randn(rows, k, device=dev, dtype=dtype)
            want = reference_outputs(x, w.codes, w.scales, w.zeros, w.layout, outputs)
            right, wrong = checked_tiles(tiles, lambda t: staged.staged_mm(x, w, t, workspace=space), want, outputs)
            assert right == tiles and wrong == {}, (n, k, rows, wrong)
    torch.cuda.synchronize()
    assert int(space.arrivals.abs().sum()) == 0, "a split product left an arrival count behind"


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"the staged kernel cannot run here: {_gpu_skip()}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zeros", [False, True], ids=["symmetric", "zeros"])
@pytest.mark.parametrize("fused", ["norm bias", "norm glu", "residual"])
def test_several_rows_with_what_the_step_fuses_are_torch_s_within_its_check(dtype, zeros, fused):
    """``staged_mm`` with the RMSNorm (each row's own), bias, SiLU·up or residual (each row's own) fused,
    as the few-row layers call it, at 3 to 16 rows, whole and split, gives what the fused step's check
    takes (:func:`triton_decode.right_tiles`: torch, rounded where the eager layer rounds, every row
    of x): a row normed by another row's RMS, a residual or an output written to another row, or a
    gate paired with another output's up moves whole outputs. Split products leave their arrival
    counts at zero."""
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(7)
    dev = torch.device("cuda")
    n, k = {"norm bias": (2048, 1536), "norm glu": (1024, 1536), "residual": (256, 8960)}[fused]
    groups = k // 128
    w = packed(n, k, dtype=dtype, device="cuda")
    if zeros:
        w = PackedMatrix(w.codes, w.scales, torch.randint(0, 16, (n, groups), device=dev).to(dtype), 4, 128, (n, k))
    kw = {}
    if "norm" in fused:
        kw.update(norm_weight=torch.empty(k, device=dev, dtype=dtype).uniform_(0.5, 1.5), eps=1e-6)
    if "bias" in fused or "glu" in fused:
        kw["bias"] = torch.randn(n, device=dev, dtype=dtype)
    glu = "glu" in fused
    if glu:
        kw["glu"] = True
    tiles = [StagedGemvConfig(nw, s) for nw in (1, 2, 4) for s in (1, 2, 3, 5, 7, 10)
             if groups % s == 0 and unfit(w, dtype, glu, StagedGemvConfig(nw, s)) is None]
    tiles = tiles[:2] + [t for t in tiles if t.split > 1][:1] + [t for t in tiles if t.warps == 4][:1]
    assert len(tiles) >= 3 and any(t.split > 1 for t in tiles), tiles
    space = SplitWorkspace(dev)

    def run(x, w, tile, **kw):
        return staged.staged_mm(x, w, tile, workspace=space, **kw)

    for rows in (3, 9, 16):
        x = torch.randn(rows, k, device=dev, dtype=dtype) * torch.linspace(0.5, 4, rows, device=dev, dtype=dtype)[:, None]
        if fused == "residual":
            kw["residual"] = torch.randn(rows, n, device=dev, dtype=dtype)
        out = torch.empty(rows, n // 2 if glu else n, device=dev, dtype=dtype)
        right, wrong = triton_decode.right_tiles(x, w, tiles, out, run, **kw)
        assert right == tiles and wrong == {}, (rows, wrong)
    torch.cuda.synchronize()
    assert int(space.arrivals.abs().sum()) == 0, "a split product left an arrival count behind"


def test_a_residual_of_another_shape_is_refused_before_anything_launches():
    w = packed(64, 1536)
    x = torch.randn(4, 1536, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"the residual must be a contiguous \[4, 64\], got \(4, 32\)"):
        staged.staged_mm(x, w, StagedGemvConfig(1), residual=torch.randn(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="glu writes SiLU"):
        staged.staged_mm(x, w, StagedGemvConfig(1), residual=torch.randn(4, 64, dtype=torch.bfloat16), glu=True)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"the staged kernel cannot run here: {_gpu_skip()}")
def test_a_batched_decode_on_the_fused_rows_is_reported_against_the_layer_s_own_products(tmp_path_factory,
                                                                                         monkeypatch):
    """Requests decoded together (2 to 4 rows, in CUDA graphs with dependent launches) run the few-row
    layers on the staged products with the norms, bias, residuals and SiLU·up fused: the report names
    a staged tile for each of the four products of that row tile, and the tokens against the same
    staged products between the layer's own compiled norms and adds (``EDGEINFER_FUSED_ROWS=0``)
    are reported by first divergence. The two sum in other orders in bf16, so a random checkpoint's
    tokens may part late; the first must agree. In both runs the few-row tuner is offered only the
    staged tiles, so that it takes them at this tiny shape; the prompt's 64-row chunks, which no
    staged tile serves, are then offered none and multiply by the dequantized weight in both."""
    from edgeinfer.quant import kernels
    from edgeinfer.quant.launching import FUSED_ROWS_ENV
    from tests.conftest import first_divergence

    tokens = _bf16_w4_tokens(tmp_path_factory, monkeypatch, together=True)
    monkeypatch.setenv(ROWS_IN_STEP_ENV, "1")  # each row tile's tiles timed in the step too (off by default)
    monkeypatch.setattr(kernels, "mm_candidates", lambda layout: [])
    monkeypatch.setattr(kernels, "mma_candidates", lambda layout, bm: [])

    monkeypatch.setenv(FUSED_ROWS_ENV, "0")
    monkeypatch.setattr(kernels, "_TUNED", {})
    own, own_report = tokens()
    monkeypatch.delenv(FUSED_ROWS_ENV)
    monkeypatch.setattr(kernels, "_TUNED", {})
    fused, report = tokens()
    assert own_report["fused_rows"] == {}, own_report["fused_rows"]
    chosen = report["fused_rows"]
    assert chosen and all(isinstance(v, dict) and all(t.startswith("staged/") for t in v.values())
                          and set(v) == {"qkv", "o", "gate_up", "down"} for v in chosen.values()), chosen
    steps = report["rows_step"]  # within the engine's default step budget
    assert set(steps) == set(chosen) and all("in_step_us" in s and "error" not in s for s in steps.values()), steps
    positions = [first_divergence(x, y) for x, y in zip(own, fused)]
    print(f"row tiles {chosen}, in the step {steps}; first divergence fused rows vs the layer's own per request "
          f"(None = identical): {positions}")
    assert all(p is None or p > 0 for p in positions)
