"""Low-bit products kept packed: the one form every checkpoint layout is brought to, the kernels
that read it, and a decoder built on it.

The kernels run on a GPU, or in Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is how
their indexing is checked here; the interpreter rounds to bfloat16 by truncation, so in bfloat16
they are compared with what the same kernels dequantize, and with torch only in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgeinfer import tile_cache
from edgeinfer.backends.registry import torch_engines
from edgeinfer.backends.torch.triton_decode import PackedGemvConfig
from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.models.loader import load_model
from edgeinfer.quant import kernels, launching
from edgeinfer.quant.launching import PackedGeometry
from edgeinfer.quant.packed import PackedMatrix, dequantize_with_torch, pack_product, why_not_packable
from edgeinfer.testing.kernel_device import DEVICE, INTERPRET
from edgeinfer.testing.quantized import quantize_awq, quantize_compressed_tensors, quantize_gptq
from tests.conftest import first_divergence, noise_image

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install 'edgeinfer[quant]')")

needs_kernels = pytest.mark.skipif(
    not (kernels.triton is not None and (torch.cuda.is_available() or INTERPRET)),
    reason="the kernels need Triton and a CUDA device, or TRITON_INTERPRET=1 for Triton's CPU interpreter")
# Triton's interpreter does not multiply bfloat16 tiles faithfully (tl.dot): those checks need a GPU.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs a CUDA device (torch.cuda.is_available() is false, or the interpreter is on)")

KINDS = {
    "w4_g32": lambda src, out: quantize_compressed_tensors(src, out, bits=4, group_size=32),
    "w4_g32_asym": lambda src, out: quantize_compressed_tensors(src, out, bits=4, group_size=32, symmetric=False),
    "w8_channel": lambda src, out: quantize_compressed_tensors(src, out, bits=8, group_size=None),
    "gptq_asym": lambda src, out: quantize_gptq(src, out, bits=4, group_size=32, symmetric=False),
    "gptq_act_order": lambda src, out: quantize_gptq(src, out, bits=4, group_size=32, desc_act=True),
    "awq": lambda src, out: quantize_awq(src, out, group_size=32),
}
PACKABLE = [k for k in KINDS if k != "gptq_act_order"]


def own_quantize(src, out, **spec) -> Path:
    """``edgeinfer quantize`` (rtn) of ``src`` into ``out``: the head too where ``spec`` asks."""
    from edgeinfer.quant.compress import QuantizeOptions, QuantSpec
    from edgeinfer.quant.quantize import quantize_checkpoint

    quantize_checkpoint(QuantizeOptions(Path(src), Path(out) / "q", QuantSpec(**spec)))
    return Path(out) / "q"


# A checkpoint whose lm_head is 4-bit too (``--lm-head int4``): the step's last product packed.
HEAD_KINDS = {"w4_g32_h4": lambda src, out: own_quantize(src, out, bits=4, group_size=32, lm_head_bits=4)}


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = {**KINDS, **HEAD_KINDS}[kind](checkpoint("qwen2_vl"), tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


def qkv_parts(path) -> list:
    weights = load_model(path, keep_packed=True).quantized.weights
    return [weights[f"model.layers.0.self_attn.{n}_proj"] for n in "qkv"]


def torch_dense(packed: PackedMatrix, dtype) -> torch.Tensor:
    return dequantize_with_torch(packed.codes, packed.scales, packed.zeros, packed.layout, dtype)


@pytest.mark.parametrize("kind", PACKABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_packed_form_holds_every_layout_s_weights(quantized, kind, dtype):
    parts = qkv_parts(quantized(kind))
    packed = pack_product(parts)
    want = torch.cat([w.dequantize(dtype) for w in parts])
    assert packed.shape == tuple(want.shape) and packed.codes.dtype == torch.int32
    assert torch.equal(torch_dense(packed, dtype), want)
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in (packed.codes, packed.scales, packed.zeros)
                                if t is not None)
    assert packed.codes.numel() * 32 == want.numel() * packed.bits  # nothing but the values in the codes


def test_act_order_is_named_as_what_keeps_a_product_dense(quantized):
    reason = why_not_packable(qkv_parts(quantized("gptq_act_order")))
    assert reason is not None and "act-order" in reason


@needs_kernels
@pytest.mark.parametrize("kind", ["w4_g32", "w4_g32_asym", "w8_channel", "awq"])
def test_kernels_read_the_packed_form_as_torch_does(quantized, kind):
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(0)
    packed = pack_product(qkv_parts(quantized(kind))).to(DEVICE)
    dense = torch_dense(packed, torch.float32)
    layout = packed.layout
    assert torch.equal(kernels.dequantize(packed.codes, packed.scales, packed.zeros, layout, torch.float32), dense)
    x = torch.randn(5, layout.k, device=DEVICE)
    # K tiles across groups (a scale per weight) and in one group (the scale after the dot); either operand order
    for config in (kernels.MmConfig(16, 128, 1), kernels.MmConfig(16, 128, 3, w_a=True), kernels.MmConfig(32, 256, 2),
                   kernels.MmConfig(32, 32, 2, w_a=True), kernels.MmConfig(16, 32, 1)):
        for _ in range(2):  # split: a second call through the counts the first left
            got = kernels.packed_mm(x, packed.codes, packed.scales, packed.zeros, layout, config)
            torch.testing.assert_close(got, x @ dense.t(), rtol=1e-4, atol=1e-4)
    assert int(kernels._workspace(torch.device(DEVICE)).arrivals.abs().sum()) == 0
    # The fused step's product with a packed weight equals it with the dense one, prologues included;
    # it never rounds a weight to the scales' dtype (AWQ's float16), so it is held to the unrounded one.
    zeros = None if packed.zeros is None else packed.zeros.float()
    unrounded = dequantize_with_torch(packed.codes, packed.scales.float(), zeros, layout, torch.float32)
    norm, residual = torch.rand(layout.k, device=DEVICE) + 0.5, torch.randn(1, layout.n, device=DEVICE)
    want = triton_decode.gemv(x[:1], unrounded, norm_weight=norm, eps=1e-6, residual=residual)
    for config in SPLIT_CONFIGS:
        got = triton_decode.packed_gemv(x[:1], packed, config, norm_weight=norm, eps=1e-6, residual=residual)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # summed per group, then per tile


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_a_split_batched_product_adds_every_split_once(bits):
    """K long enough for every split to hold columns: the last split of each tile to arrive adds
    all the partials (a split left out or added twice changes the product), and the counts it
    leaves at zero let a second call through them give the same product."""
    torch.manual_seed(4)
    n, k, group = 48, 1024, 64
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=DEVICE)
    scales = torch.rand(n, k // group, device=DEVICE) * 0.01 + 0.001
    zeros = torch.randint(0, 2 ** bits, (n, k // group), device=DEVICE).float()
    packed = PackedMatrix(codes, scales, zeros, bits, group, (n, k))
    x = torch.randn(3, k, device=DEVICE)
    want = x @ dequantize_with_torch(codes, scales, zeros, packed.layout, torch.float32).t()
    for config in (kernels.MmConfig(16, 128, 4), kernels.MmConfig(32, 64, 4, w_a=True)):
        for _ in range(2):
            got = kernels.packed_mm(x, codes, scales, zeros, packed.layout, config)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert int(kernels._workspace(torch.device(DEVICE)).arrivals.abs().sum()) == 0


# Whole rows and K split three ways (short tiles: the tiny rows are split too, the last split partial);
# tiles of one group of 32 and of two.
SPLIT_CONFIGS = [PackedGemvConfig(8, bk, 4, split) for bk in (32, 64) for split in (1, 3)]


@needs_kernels
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "rmsnorm_glu"])
def test_a_split_product_equals_the_whole_row_and_leaves_its_counts_at_zero(quantized, prologue):
    """The last of a tile's splits to arrive adds the partials and writes the row; every count is
    back to zero after, so the next product (or graph replay) starts clean. With ``glu`` the rows
    are read as gate | up and the row written is SiLU(gate)·up (half as many outputs, the last
    tile cut short)."""
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(3)
    packed = pack_product(qkv_parts(quantized("w4_g32_asym"))).to(DEVICE)
    n, k = packed.shape
    x = torch.randn(1, k, device=DEVICE)
    kw = {}
    if prologue.startswith("rmsnorm"):
        kw.update(norm_weight=torch.rand(k, device=DEVICE) + 0.5, eps=1e-6)
    if prologue.endswith("glu"):  # 58 gate | 58 up rows: the last tile of four outputs cut short
        n = 116
        packed = PackedMatrix(packed.codes[:n], packed.scales[:n], packed.zeros[:n], packed.bits, packed.group_size,
                              (n, k))
        kw["glu"] = True
    else:
        kw["residual"] = torch.randn(1, n, device=DEVICE)
    kw["bias"] = torch.randn(n, device=DEVICE)
    dense = dequantize_with_torch(packed.codes, packed.scales, packed.zeros, packed.layout, torch.float32)
    want = triton_decode.gemv(x, dense, **kw)
    workspace = triton_decode.SplitWorkspace(torch.device(DEVICE))
    for config in SPLIT_CONFIGS:
        for _ in range(2):  # a second call through the same counts
            got = triton_decode.packed_gemv(x, packed, config, workspace=workspace, **kw)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert int(workspace.arrivals.abs().sum()) == 0
    assert workspace.arrivals.numel() > 0, "no product was split"


@needs_kernels
def test_kernels_in_bfloat16_read_what_they_dequantize(quantized):
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(1)
    packed = pack_product(qkv_parts(quantized("w4_g32_asym"))).to(DEVICE)
    packed.scales = packed.scales.bfloat16()
    packed.zeros = packed.zeros.bfloat16()
    layout = packed.layout
    dense = kernels.dequantize(packed.codes, packed.scales, packed.zeros, layout, torch.bfloat16)
    x = torch.randn(1, layout.k, device=DEVICE, dtype=torch.bfloat16)
    got = triton_decode.packed_gemv(x, packed, triton_decode.PACKED_GEMV_CANDIDATES[0]).float()
    want = triton_decode.gemv(x, dense).float()
    assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-2  # a bfloat16 step of the largest output


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
# whole tiles, and tiles cut at both edges; groups of 32 and 64 columns (several to a step), of 256
# (a step within one group), of 96 (not a power of two: a scale read a word), and one a row
@pytest.mark.parametrize("n,k,group", [(48, 1024, 64), (40, 1000, 32), (48, 1024, 256), (40, 960, 96),
                                       (48, 1024, 1024), (40, 1000, 1000)])
def test_a_bfloat16_row_is_the_exact_product_rounded_once(bits, n, k, group):
    """With 16-bit activations the batch-1 product takes the codes biased (2^e + q) and takes the
    bias off per word: every product is exact and only the float32 sums round, so the row equals
    the float32 product of the same values, rounded once to bfloat16 (a bias, a shift or a zero
    point off by one code moves whole outputs by far more than a bfloat16 step)."""
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(5)
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=DEVICE)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, device=DEVICE) * 0.02 + 0.001).bfloat16()
    for zeros in (None, torch.randint(0, 2 ** bits, (n, groups), device=DEVICE).bfloat16()):
        packed = PackedMatrix(codes, scales, zeros, bits, group, (n, k))
        dense = dequantize_with_torch(codes, scales.float(), None if zeros is None else zeros.float(), packed.layout,
                                      torch.float32)
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        want = (x.float() @ dense.t()).bfloat16().float()
        # whole steps, split three ways, and a 2,048-column tile, which takes a row of 1,000 or 960 in one step
        for config in (PackedGemvConfig(16, 256, 4), PackedGemvConfig(8, 128, 4, 3), PackedGemvConfig(8, 2048, 4)):
            got = triton_decode.packed_gemv(x, packed, config).float()
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(48, 1024, 64), (40, 1000, 32), (40, 960, 96), (40, 1000, 1000)])
def test_an_integer_dot_row_is_the_product_within_x_s_rounding_to_integers(dtype, bits, n, k, group):
    """An integer-dot tile takes each word's columns of x as integers at the word's own scale (the largest to
    32,767 for 4-bit codes, 4,095 for 8-bit), so each x_i moves by half a step of that scale at most, and the
    integer dots are exact: every output is within what those steps move it by, plus one rounding to the
    activations' dtype. Groups of a power of two, of 96 and one a row; with and without zero points; whole
    and split rows; tiles cut at N and K. A nibble or byte paired with the wrong column of x, a pair's halves
    swapped or a zero point's share taken off wrong moves outputs far past that bound."""
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(7)
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=DEVICE)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, device=DEVICE) * 0.02 + 0.001).to(dtype)
    per, steps = 32 // bits, 32767 if bits == 4 else 4095
    for zeros in (None, torch.randint(0, 2 ** bits, (n, groups), device=DEVICE).to(dtype)):
        packed = PackedMatrix(codes, scales, zeros, bits, group, (n, k))
        dense = dequantize_with_torch(codes, scales.float(), None if zeros is None else zeros.float(), packed.layout,
                                      torch.float32)
        # columns of very different sizes, so that a word's small values lose digits to its large one
        x = (torch.randn(1, k, device=DEVICE) * torch.exp(2 * torch.randn(1, k, device=DEVICE))).to(dtype)
        want = x.float() @ dense.t()
        words = torch.nn.functional.pad(x.float().abs(), (0, -k % per)).view(-1, per).amax(1)
        moved = (words / steps / 2).repeat_interleave(per)[:k] * (1 + 2 ** -20)
        # plus a unit in the last place: the interpreter truncates where a GPU rounds to nearest
        bound = dense.abs() @ moved + 2 ** -7 * want.abs()[0] + 1e-30
        tiles = (PackedGemvConfig(16, 256, 4, idot=True), PackedGemvConfig(8, 128, 4, 3, idot=True),
                 PackedGemvConfig(8, 2048, 4, idot=True))  # the last: rows of 1,000 or 960 in one step
        for config in tiles + ((PackedGemvConfig(8, 512, 2, idot=True),) if bits == 8 else ()):
            got = triton_decode.packed_gemv(x, packed, config).float()
            assert bool(((got - want).abs()[0] <= bound).all()), (config, ((got - want).abs()[0] / bound).max())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=needs_cuda)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(48, 1024, 64), (40, 1000, 32), (40, 1000, 1000)])
def test_a_16_bit_batched_product_is_the_exact_product_rounded_once(dtype, bits, n, k, group):
    """With 16-bit activations and K tiles that lie in one group, the batched product dots the
    exact integers ``q - z`` and scales the dot: only the float32 sums round, so every row equals
    the float32 product of the same values, rounded once (a code, zero point or scale read from
    the wrong place, or the output tile stored transposed wrong, moves whole outputs)."""
    torch.manual_seed(6)
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=DEVICE)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, device=DEVICE) * 0.02 + 0.001).to(dtype)
    bk = 32 if group < 64 else 64
    for zeros in (None, torch.randint(0, 2 ** bits, (n, groups), device=DEVICE).to(dtype)):
        packed = PackedMatrix(codes, scales, zeros, bits, group, (n, k))
        dense = dequantize_with_torch(codes, scales.float(), None if zeros is None else zeros.float(), packed.layout,
                                      torch.float32)
        x = torch.randn(3, k, device=DEVICE).to(dtype)
        want = (x.float() @ dense.t()).to(dtype).float()
        for config in (kernels.MmConfig(16, bk, 1), kernels.MmConfig(32, bk, 3, w_a=True)):
            got = kernels.packed_mm(x, packed.codes, packed.scales, packed.zeros, packed.layout, config).float()
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(200, 1024, 128), (136, 1024, 64), (72, 1536, 2048)])
def test_the_tensor_core_product_is_the_dequantized_product_rounded_once(dtype, n, k, group):
    """The 4-bit tensor-core kernel rebuilds each weight as ``(q - z)·s`` rounded once to the
    activations' dtype, as the dequantized weight is, so every row equals the float32 product with
    that weight rounded once: for 1, 5 and 16 rows, tiles cut short at N, K whole and split three
    (unevenly) and sixteen ways, with and without zero points (a code taken from the wrong nibble,
    a pair put in the wrong half, or a row of x read as another moves whole outputs); the same with x
    put in shared memory first (a step's slice read from the wrong place moves whole outputs too), and
    with a lane's words side by side, x read from memory or put in shared memory (x in another
    permutation than the weight's columns moves whole outputs); and staged, every step's words in
    shared memory at once (a step read from another step's buffer moves whole outputs)."""
    from edgeinfer.quant import tensor_core

    if (why := tensor_core.unavailable(torch.empty(1, k, dtype=dtype, device="cuda"), dtype, 4, group, n, k)) is not None:
        pytest.skip(f"the tensor-core kernel cannot run here: {why}")
    torch.manual_seed(7)
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    groups = -(-k // group)
    scales = (torch.rand(n, groups, device="cuda") * 0.02 + 0.001).to(dtype)
    for zeros in (None, torch.randint(0, 16, (n, groups), device="cuda").to(dtype)):
        packed = PackedMatrix(codes, scales, zeros, 4, group, (n, k))
        dense = dequantize_with_torch(codes, scales, zeros, packed.layout, dtype).float()
        for rows in (1, 5, 16):
            x = torch.randn(rows, k, device="cuda").to(dtype)
            want = (x.float() @ dense.t()).to(dtype).float()
            long = 128 if group % 128 == 0 else 64
            for bn, bk, split, stages, x_shared, wide, staged in (
                    (64, 64, 1, 2, False, False, False), (128, long, 3, 3, False, False, False),
                    (256, 64, 16, 4, False, False, False), (64, 64, 1, 2, True, False, False),
                    (128, long, 3, 4, True, False, False),
                    (64, 64, 1, 2, False, True, False), (128, long, 3, 3, False, True, False),
                    (128, long, 3, 4, True, True, False),
                    (64, long, 2, 2, True, True, True), (128, 64, 4, 2, True, False, True)):
                if staged and (k // bk) % split:
                    continue  # staged splits take the same steps each
                config = kernels.MmConfig(bn, bk, split, stages=stages, mma=True, x_shared=x_shared, wide=wide,
                                          staged=staged)
                got = kernels.packed_mm(x, packed.codes, packed.scales, packed.zeros, packed.layout, config).float()
                torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item(),
                                           msg=lambda m: f"{rows} rows, {config}, zeros {zeros is not None}: {m}")


def test_the_tensor_core_tiles_timed_at_16_rows_are_the_shared_ones_and_two_register_ones(monkeypatch):
    """At 8 rows the tuner times the register tiles; at 16 the x-shared tiles and the two register
    tiles that measured fastest there (:data:`kernels.ROW16_REGISTER_TILES`), each where the row
    has the steps its split needs; staged tiles only with their switch."""
    monkeypatch.delenv(launching.STAGED_MMA_ENV, raising=False)
    gate_up, short = PackedGeometry(17920, 1536, 4, 12, 128), PackedGeometry(256, 256, 4, 2, 128)
    eight, sixteen = kernels.mma_candidates(gate_up, 8), kernels.mma_candidates(gate_up, 16)
    assert eight and not any(c.x_shared or c.wide for c in eight)
    assert [c for c in sixteen if not c.x_shared] == list(kernels.ROW16_REGISTER_TILES)
    assert all(c.mma and not c.staged for c in sixteen)
    assert kernels.ROW16_REGISTER_TILES[0].wide and kernels.ROW16_REGISTER_TILES[0].split == 4
    # 4 steps of 64 columns: split 4 fits, split 8 does not
    assert [c for c in kernels.mma_candidates(short, 16) if not c.x_shared] == [kernels.ROW16_REGISTER_TILES[0]]


def test_a_tile_comes_back_from_the_tile_cache_as_the_kernel_s_own_tile():
    """The few-row tuner keeps the staged kernel's tiles and its own in one cache kind: each entry
    names its kernel, so a staged tile is not read back as a tensor-core one (or refused as none)."""
    from edgeinfer.quant.staged import StagedGemvConfig

    for tile in (StagedGemvConfig(2, 10), kernels.MmConfig(64, 128, 4, stages=4, mma=True, wide=True),
                 kernels.MmConfig(32, 128, 8, w_a=True)):
        assert kernels._kept_config(kernels._cache_fields(tile)) == tile
    assert kernels._cache_fields(StagedGemvConfig(4, 1))["kernel"] == kernels.STAGED_KERNEL
    assert kernels._kept_config({"kernel": kernels.STAGED_KERNEL, "bn": 64}) is None  # a field it does not have
    assert kernels._tile_name(StagedGemvConfig(1, 10)) == "staged 1w/split10"


def test_one_row_is_tuned_apart_from_the_few_rows_a_staged_tile_takes():
    """A staged tile takes 2 to 16 rows, so one row has a row tile of its own: a tile tuned for 2 to 8
    rows never serves it, and a tuning at one row never decides for 2 to 8."""
    assert [kernels.row_tile(r) for r in (1, 2, 8, 9, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]


@needs_kernels
def test_a_staged_tile_that_cannot_take_a_weight_gives_the_dot_kernel_s_product():
    """A tile is tuned for a layout; a weight of that layout the staged kernel cannot take (codes not
    16-byte aligned on a GPU; here, no GPU at all) gets the dot kernel's tile instead of an error."""
    from edgeinfer.quant.staged import StagedGemvConfig

    w = random_packed(64, 256, 128, device=DEVICE)  # bf16, groups of 128: a layout the staged kernel takes
    x = torch.randn(4, 256, device=DEVICE).bfloat16()
    if DEVICE == "cuda":
        codes = torch.empty(w.codes.numel() + 1, dtype=torch.int32, device="cuda")[1:].view_as(w.codes)
        codes.copy_(w.codes)  # 4 bytes past a 16-byte boundary
    else:
        codes = w.codes
    got = kernels.packed_mm(x, codes, w.scales, None, w.layout, StagedGemvConfig(1, 1))
    want = kernels.packed_mm(x, w.codes, w.scales, None, w.layout, kernels.mm_config(w.layout, 4, x.device))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_staged_tiles_are_timed_for_two_to_sixteen_rows_unless_switched_off(monkeypatch):
    """With ``$EDGEINFER_STAGED_ROWS=0``, off a GPU, at one row (the fused step's own tuner) or past
    16 rows (two MMAs of 8 columns), the few-row tuner times no staged tile."""
    w = random_packed(256, 1536, 128)
    args = (w.codes, w.scales, None, w.layout)
    monkeypatch.setenv(launching.STAGED_ROWS_ENV, "0")
    assert not launching.staged_rows_enabled()
    assert kernels.staged_rows_candidates(torch.randn(16, 1536, dtype=torch.bfloat16), *args) == []
    monkeypatch.delenv(launching.STAGED_ROWS_ENV)
    assert launching.staged_rows_enabled()
    for rows in (1, 17):
        assert kernels.staged_rows_candidates(torch.randn(rows, 1536, dtype=torch.bfloat16), *args) == []
    assert kernels.staged_rows_candidates(torch.randn(8, 1536, dtype=torch.bfloat16), *args) == []  # a CPU tensor


@needs_cuda
def test_a_few_row_product_runs_on_the_staged_tile_it_is_given_and_falls_back_where_it_cannot(monkeypatch):
    """``packed_mm`` with a staged tile gives torch's product at 2 to 16 rows; a weight the tile cannot
    copy (codes not 16-byte aligned) takes the dot kernel's tile instead of failing; and the tuner
    times the staged tiles beside its own, checks them, and keeps a right one."""
    from edgeinfer.quant import staged
    from edgeinfer.quant.staged import StagedGemvConfig

    if (why := staged.unavailable(torch.device("cuda"))) is not None:
        pytest.skip(f"the staged kernel cannot run here: {why}")
    monkeypatch.delenv(launching.STAGED_ROWS_ENV, raising=False)
    monkeypatch.setenv(tile_cache.TILE_CACHE_ENV, "off")
    w = random_packed(512, 1536, 128, device="cuda")
    outputs = kernels.checked_outputs(512)
    for rows in (2, 16):
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        want = kernels.reference_outputs(x, w.codes, w.scales, None, w.layout, outputs)
        tiles = kernels.staged_rows_candidates(x, w.codes, w.scales, None, w.layout)
        assert tiles and all(isinstance(t, StagedGemvConfig) for t in tiles)
        got = kernels.packed_mm(x, w.codes, w.scales, None, w.layout, tiles[-1])
        assert kernels.divergence(got[:, outputs.cuda()], want, outputs) is None
        shifted = torch.empty(w.codes.numel() + 1, dtype=torch.int32, device="cuda")[1:].view_as(w.codes)
        shifted.copy_(w.codes)  # 4 bytes past a 16-byte boundary
        assert staged.unfit(launching.PackedParts(shifted, w.scales, None, w.layout), x.dtype, False, tiles[-1])
        got = kernels.packed_mm(x, shifted, w.scales, None, w.layout, tiles[-1])
        assert kernels.divergence(got[:, outputs.cuda()], want, outputs) is None
        got = kernels.packed_mm(x, w.codes, w.scales, None, w.layout)  # tuned, the staged tiles among the timed
        assert kernels.divergence(got[:, outputs.cuda()], want, outputs) is None
    chosen = [c for c in kernels.tuned_choices() if (c["n"], c["k"]) == (512, 1536)]
    assert {c["row_tile"] for c in chosen} >= {8, 16} and not any("wrong_outputs" in c for c in chosen)


def test_tuning_copies_a_weight_until_the_copies_fill_three_l2_caches_and_no_further():
    mb = 2 ** 20
    assert kernels.cold_copies(mb, 60 * mb) == 180  # an H200's 60 MB L2: 180 one-MB copies
    assert kernels.cold_copies(14 * mb, 60 * mb) == 13 and kernels.cold_copies(14 * mb, 4 * mb) == 1  # Orin: none
    assert kernels.cold_copies(1024, 60 * mb) == 256  # a tiny weight: capped
    assert kernels.cold_copies(233 * mb, 60 * mb) == 1  # a vocabulary's int8 head: read as it is


def random_packed(n: int, k: int, group: int, bits: int = 4, zeros: bool = False, device: str = "cpu",
                  dtype=torch.bfloat16) -> PackedMatrix:
    torch.manual_seed(n + k)
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=device)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, device=device) * 0.02 + 0.001).to(dtype)
    z = torch.randint(0, 2 ** bits, (n, groups), device=device).to(dtype) if zeros else None
    return PackedMatrix(codes, scales, z, bits, group, (n, k))


def test_a_tile_is_checked_at_both_ends_of_n_and_between_against_torch_s_product():
    """The check reads the first and last outputs (tiles cut short at N's end) and outputs spread
    between, and its reference is the product with the dequantized weight at exactly those outputs."""
    assert kernels.checked_outputs(40).tolist() == list(range(40))
    outputs = kernels.checked_outputs(5000)
    assert outputs[:128].tolist() == list(range(128)) and outputs[-128:].tolist() == list(range(4872, 5000))
    inner = outputs[128:-128]  # the spread between the ends, some 39 outputs apart
    assert len(inner) >= 118 and bool((inner.diff() >= 39).all()) and outputs.unique().numel() == len(outputs)
    packed = random_packed(300, 256, 64, zeros=True)
    x = torch.randn(3, 256).bfloat16()
    dense = dequantize_with_torch(packed.codes, packed.scales, packed.zeros, packed.layout, torch.bfloat16)
    outputs = kernels.checked_outputs(300)
    want = (x.float() @ dense.float().t()).bfloat16().float()[:, outputs]
    got = kernels.reference_outputs(x, packed.codes, packed.scales, packed.zeros, packed.layout, outputs)
    assert torch.equal(got, want)


def test_a_divergence_names_the_first_output_a_tile_got_wrong_and_rounding_is_none():
    torch.manual_seed(3)
    want = torch.randn(4, 200).bfloat16().float()
    assert kernels.divergence(want.clone(), want) is None
    # another summation order: the float32 sum rounded to bf16 a unit the other way
    ulp = want.abs() * 2 ** -8
    assert kernels.divergence(want + ulp * torch.sign(torch.randn_like(want)), want) is None
    wrong = want.clone()
    wrong[2, 57] += 0.5  # a code from the wrong nibble moves an output by a scale's worth or more
    outputs = torch.arange(1000, 1200)
    why = kernels.divergence(wrong, want, outputs)
    assert why is not None and why.startswith("row 2, output 1057:")
    swapped = want[:, torch.arange(200).roll(1)]  # outputs written one place over
    assert kernels.divergence(swapped, want).startswith("row 0, output 0:")


def kernel_arithmetic(x, w: PackedMatrix, norm_weight=None, eps=0.0, bias=None, glu=False, residual=None):
    """``packed_gemv``'s arithmetic in torch, rounded to nearest as a GPU rounds: rstd from a sum of
    squares taken in chunks, the product with the exact ``(q - z)`` summed a group at a time and
    then scaled (the weight never rounded), the epilogues rounded where the kernel rounds."""
    dt = x.dtype
    h = x.float()
    if norm_weight is not None:
        rstd = 1.0 / torch.sqrt(h.pow(2).view(1, -1, 64).sum(-1).sum(-1, keepdim=True) / h.shape[1] + eps)
        h = ((h * rstd).to(dt).float() * norm_weight.float()).to(dt).float()
    n, k = w.shape
    shifts = torch.arange(0, 32, w.bits, dtype=torch.int32)
    q = ((w.codes.unsqueeze(-1) >> shifts) & ((1 << w.bits) - 1)).reshape(n, -1)[:, :k].float()
    group = min(w.group_size, k)
    z = w.zeros.float().repeat_interleave(group, 1) if w.zeros is not None else 2 ** (w.bits - 1)
    y = (((q - z) * h).view(n, -1, group).sum(-1) * w.scales.float()).sum(-1)[None].to(dt)
    if bias is not None:
        y = (y.float() + bias.float()).to(dt)
    if glu:
        gate, up = y[:, :n // 2].float(), y[:, n // 2:].float()
        y = ((gate * torch.sigmoid(gate)).to(dt).float() * up).to(dt)
    if residual is not None:
        y = (y.float() + residual.float()).to(dt)
    return y.float()


@pytest.mark.parametrize("product", ["gate_up", "down", "lm_head", "lm_head_w4"])
def test_the_check_s_bounds_hold_for_the_kernels_arithmetic(product):
    """The fused step's check (``triton_decode.reference_product`` against ``kernels.divergence``)
    passes the kernels' own arithmetic rounded to nearest, as a GPU computes it, on every output
    and by a margin (Qwen2-VL-2B's gate|up with its norm, bias and SiLU·up, 4-bit with zero points;
    down with a residual; an 8-bit head a scale a row, a 4-bit one in groups of 128), while a code
    read from the wrong nibble in one weight row fails it. The check cannot refuse a right tile
    over rounding."""
    from edgeinfer.backends.torch import triton_decode

    torch.manual_seed(11)
    dt = torch.bfloat16
    n, k, bits, group = {"gate_up": (4096, 1536, 4, 128), "down": (1536, 8960, 4, 128),
                         "lm_head": (8192, 1536, 8, 1536), "lm_head_w4": (8192, 1536, 4, 128)}[product]
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32)
    scales = (torch.rand(n, k // group) * (0.02 if bits == 4 else 0.002) + 0.001).to(dt)
    zeros = torch.randint(0, 16, (n, k // group)).to(dt) if product == "gate_up" else None
    w = PackedMatrix(codes, scales, zeros, bits, group, (n, k))
    x = torch.randn(1, k).to(dt)
    kw = {"down": {"residual": torch.randn(1, n).to(dt)}}.get(product, {
        "norm_weight": torch.empty(k).uniform_(0.5, 1.5).to(dt), "eps": 1e-6})
    if product == "gate_up":
        kw.update(bias=torch.randn(n).to(dt), glu=True)
    outputs = torch.arange(n // 2 if kw.get("glu") else n)
    want = triton_decode.reference_product(x, w, outputs, **kw)
    got = kernel_arithmetic(x, w, **kw)
    assert kernels.divergence(got, want, outputs) is None
    bound = 2 ** -5 * want.abs() + 2 ** -7 * want.abs().max()
    assert ((got - want).abs() / bound).max() < 0.6  # the worst output uses under 60% of its bound
    codes = codes.clone()
    codes[7] = codes[7] >> 4 | codes[7] << 28  # row 7's codes one nibble over
    moved = kernel_arithmetic(x, PackedMatrix(codes, scales, zeros, bits, group, (n, k)), **kw)
    assert kernels.divergence(moved, want, outputs).startswith("row 0, output 7:")


@needs_kernels
def test_the_tuner_refuses_a_tile_whose_outputs_are_not_torch_s(monkeypatch):
    """Before a tile is timed its outputs are checked against torch's: a tile whose kernel moves one
    output is refused, with where, and the others are kept; the kernels' own tiles all pass (here in
    float32, which the interpreter multiplies faithfully)."""
    packed = random_packed(96, 512, 128, zeros=True, device=DEVICE, dtype=torch.float32)
    x = torch.randn(3, 512, device=DEVICE)
    tiles = [kernels.MmConfig(32, 128, 1), kernels.MmConfig(64, 128, 2), kernels.MmConfig(32, 64, 4, w_a=True)]
    key = ("tiles", DEVICE)
    kernels._WRONG.pop(key, None)
    args = (x, packed.codes, packed.scales, packed.zeros, packed.layout)
    assert kernels._right_tiles(key, tiles, *args) == tiles and key not in kernels._WRONG

    real = kernels.packed_mm

    def one_tile_wrong(x, codes, scales, zeros, layout, config=None, warmup=False):
        y = real(x, codes, scales, zeros, layout, config, warmup)
        if config == tiles[1]:
            y[1, 95] += 1.0  # the last output, in the tile cut short at N's end
        return y

    monkeypatch.setattr(kernels, "packed_mm", one_tile_wrong)
    assert kernels._right_tiles(key, tiles, *args) == [tiles[0], tiles[2]]
    assert kernels._WRONG.pop(key)[tiles[1]].startswith("row 1, output 95:")


def test_a_product_left_without_a_tile_says_why(monkeypatch):
    """Where no tile is left to time, the warning names the first wrong tile and where it was wrong;
    else the compiler's refusal; else that none was offered (a tuner given no candidates), rather
    than failing on a missing entry."""
    monkeypatch.setattr(kernels, "_WRONG", {})
    monkeypatch.setattr(kernels, "_REFUSED", {})
    key = ("product", "cuda")
    assert kernels._why_no_tile(key) == "no tile is offered"
    kernels._REFUSED[key] = "CompilationError: out of shared memory"
    assert kernels._why_no_tile(key) == "every tile was refused on this GPU (CompilationError: out of shared memory)"
    tile = kernels.MmConfig(32, 128, 1)
    kernels._WRONG[key] = {tile: "row 1, output 95: 0.5 where 1.5"}
    assert kernels._why_no_tile(key) == (f"every tile gave wrong outputs on this GPU (tile {kernels._tile_name(tile)}: "
                                         "row 1, output 95: 0.5 where 1.5)")


@needs_cuda
def test_a_tile_with_wrong_outputs_is_never_chosen_and_none_right_falls_back_to_torch(monkeypatch):
    """On the GPU the tuner drops a wrong tile before timing and reports it; where every tile is
    wrong it warns and multiplies by the dequantized weight, which gives torch's outputs."""
    monkeypatch.setenv(tile_cache.TILE_CACHE_ENV, "off")  # each tuning below times afresh
    packed = random_packed(512, 2048, 128, device="cuda")
    x = torch.randn(5, 2048, device="cuda").bfloat16()
    args = (packed.codes, packed.scales, None, packed.layout)
    real = kernels.packed_mm
    wrong_tiles = {kernels.mm_candidates(packed.layout)[0]}

    def some_tiles_wrong(x, codes, scales, zeros, layout, config=None, warmup=False):
        y = real(x, codes, scales, zeros, layout, config, warmup)
        if y is not None and config in wrong_tiles:
            y[0, 0] += 1.0
        return y

    monkeypatch.setattr(kernels, "packed_mm", some_tiles_wrong)
    kernels._TUNED.clear()
    kernels._WRONG.clear()
    chosen = kernels.tuned_config(x, *args)
    assert chosen is not None and chosen not in wrong_tiles
    [choice] = [c for c in kernels.tuned_choices() if (c["n"], c["k"]) == (512, 2048)]
    assert list(choice["wrong_outputs"]) == [kernels._tile_name(t) for t in wrong_tiles]

    wrong_tiles.update(kernels.mm_candidates(packed.layout) + kernels.mma_candidates(packed.layout, 8)
                       + kernels.staged_rows_candidates(x, *args))
    kernels._TUNED.clear()
    kernels._WRONG.clear()
    with pytest.warns(UserWarning, match="gave wrong outputs on this GPU"):
        assert kernels.tuned_config(x, *args) is None
    dense = dequantize_with_torch(packed.codes, packed.scales, None, packed.layout, torch.bfloat16)
    torch.testing.assert_close(real(x, *args), x @ dense.t())
    assert [c["kernel"] for c in kernels.tuned_choices() if (c["n"], c["k"]) == (512, 2048)] == ["torch"]
    kernels._TUNED.clear()
    kernels._WRONG.clear()


@needs_cuda
def test_the_tuner_times_every_tile_from_a_graph_and_keeps_a_correct_one(monkeypatch, tmp_path):
    """On first use ``packed_mm`` times its tiles (the tensor-core kernel's among them where it can
    run) over copies of the weight that miss the L2 cache, keeps one for the shape and row tile,
    frees the copies, and the kept tile computes what any other does. The choice is kept in the
    tile cache too: a later process (here, the same one with its choices forgotten) takes it
    without timing anything."""
    monkeypatch.setenv(tile_cache.TILE_CACHE_ENV, str(tmp_path / "tiles"))
    torch.manual_seed(8)
    n, k, group = 512, 2048, 128
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // group, device="cuda") * 0.02 + 0.001).bfloat16()
    packed = PackedMatrix(codes, scales, None, 4, group, (n, k))
    x = torch.randn(5, k, device="cuda").bfloat16()
    kernels._TUNED.clear()
    kernels.packed_mm(x, codes, scales, None, packed.layout, kernels.MmConfig(32, 128, 1))  # workspace, compiles
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    chosen = kernels.tuned_config(x, codes, scales, None, packed.layout)
    assert torch.cuda.memory_allocated() <= before + 2 ** 20  # the copies are gone (the split workspace may grow)
    staged_tiles = kernels.staged_rows_candidates(x, codes, scales, None, packed.layout)
    assert chosen in kernels.mm_candidates(packed.layout) + kernels.mma_candidates(packed.layout, 8) + staged_tiles
    assert kernels.tuned_config(x, codes, scales, None, packed.layout) is chosen  # kept, not timed again
    [choice] = [c for c in kernels.tuned_choices() if (c["n"], c["k"], c["row_tile"]) == (n, k, 8)]
    kind = kernels.STAGED_KERNEL if chosen in staged_tiles else "tensor_core" if chosen.mma else "dot"
    assert choice["kernel"] == kind and choice["source"] == "timed"
    want = kernels.packed_mm(x, codes, scales, None, packed.layout, kernels.MmConfig(32, 128, 1)).float()
    got = kernels.packed_mm(x, codes, scales, None, packed.layout).float()
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())

    kernels._TUNED.clear()
    tile_cache.forget_reads()
    monkeypatch.setattr(kernels, "graph_time_us", lambda calls: pytest.fail("timed a tile the cache holds"))
    assert kernels.tuned_config(x, codes, scales, None, packed.layout) == chosen
    [choice] = [c for c in kernels.tuned_choices() if (c["n"], c["k"], c["row_tile"]) == (n, k, 8)]
    assert choice["source"] == "cache"


@needs_cuda
def test_batched_kernel_in_bfloat16_reads_what_it_dequantizes(quantized):
    torch.manual_seed(2)
    packed = pack_product(qkv_parts(quantized("w4_g32_asym"))).to("cuda")
    packed.scales, packed.zeros = packed.scales.bfloat16(), packed.zeros.bfloat16()
    layout = packed.layout
    dense = kernels.dequantize(packed.codes, packed.scales, packed.zeros, layout, torch.bfloat16)
    for rows in (2, 16, 64):
        x = torch.randn(rows, layout.k, device="cuda", dtype=torch.bfloat16)
        got = kernels.packed_mm(x, packed.codes, packed.scales, packed.zeros, layout).float()
        want = x.float() @ dense.float().t()
        assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-2


def engine_over(model) -> Engine:
    config = EngineConfig(block_size=16, num_blocks=256)
    return Engine(model, config, torch_engines(model, config))


FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)


@pytest.mark.parametrize("kind", ["w4_g32", "gptq_asym", "gptq_act_order", "w4_g32_h4"])
def test_a_decoder_on_packed_products_generates_the_dense_decoder_s_tokens(quantized, kind):
    """Packed products (dequantized per product by torch on this CPU) in place of dense ones: the
    same tokens, text and image; act-order products stay dense and say why. With a 4-bit lm_head
    the head is packed too."""
    path = quantized(kind)
    packed_model, dense_model = load_model(path, keep_packed=True), load_model(path, keep_packed=False)
    products = [getattr(layer, n) for layer in packed_model.decoder.layers for n in ("qkv_t", "o_t", "gate_up_t",
                                                                                      "down_t")]
    kept = sum(isinstance(p, PackedMatrix) for p in products)
    assert kept == (0 if kind == "gptq_act_order" else len(products))
    assert isinstance(packed_model.decoder.lm_head_t, PackedMatrix) is (kind in HEAD_KINDS)
    packed_engine, dense_engine = engine_over(packed_model), engine_over(dense_model)
    for images in ([], [noise_image(120, 80, seed=3)]):
        got = packed_engine.run_until_done([packed_engine.submit("how many circle are there ?", images, FORCED)])
        want = dense_engine.run_until_done([dense_engine.submit("how many circle are there ?", images, FORCED)])
        assert len(set(want[0].token_ids)) >= 8, "a near-constant sequence would make this comparison meaningless"
        assert got[0].token_ids == want[0].token_ids


# --- on a GPU: the fused batch-1 step and the batched products read the packed weights --------

REQUESTS = [("what is in the image ?", [noise_image(128, 96, seed=1)]), ("describe this picture", []),
            ("color", [noise_image(80, 128, seed=7)])]
STEPS = SamplingParams(max_new_tokens=32, ignore_eos=True)


def cuda_tokens(path, *, together: bool, keep_packed: bool | None = None, **config) -> tuple[list[list[int]], Engine]:
    """Tokens of REQUESTS one at a time (batch 1: the fused step) or all at once (the batched products)."""
    settings = EngineConfig(num_blocks=512, max_batch_size=4, device="cuda", cuda_graphs=True, **config)
    model = load_model(path, settings.torch_dtype, "cuda", keep_packed=keep_packed)
    engine = Engine(model, settings, torch_engines(model, settings))
    if together:
        seqs = [engine.submit(q, images, STEPS) for q, images in REQUESTS]
        return [r.token_ids for r in engine.run_until_done(seqs)], engine
    return [engine.generate(q, images, STEPS).token_ids for q, images in REQUESTS], engine


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["w4_g32_asym", "w8_channel", "w4_g32_h4"])
@pytest.mark.parametrize("together", [False, True], ids=["batch1_fused", "batched"])
def test_packed_products_on_cuda_in_fp32_give_the_dense_tokens(quantized, kind, together):
    path = quantized(kind)
    dense, _ = cuda_tokens(path, together=together, keep_packed=False)
    packed, engine = cuda_tokens(path, together=together)
    assert isinstance(engine.model.decoder.layers[0].gate_up_t, PackedMatrix)
    assert isinstance(engine.model.decoder.lm_head_t, PackedMatrix) is (kind in HEAD_KINDS)
    if not together and kernels.triton is not None:
        report = engine.decoder_engine.kernel_report
        assert report["fused"] and report["fused_replays"] > 0, report
    assert packed == dense


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("together", [False, True], ids=["batch1_fused", "batched"])
@pytest.mark.parametrize("kind", ["w4_g32", "w8_channel", "w4_g32_h4"])  # 8-bit: one byte permute a code (WIDE)
def test_packed_products_on_cuda_in_bf16_against_dense_are_reported(quantized, together, kind):
    """In bfloat16 the packed and dense products sum in other orders: tokens of a random checkpoint
    may part late. The first divergence is printed; the first token must agree. At batch 1 the
    fused step runs, and none of its tiles failed the check against torch (a false refusal in
    bf16 would have turned it off)."""
    path = quantized(kind)
    dense, _ = cuda_tokens(path, together=together, keep_packed=False, dtype="bfloat16")
    packed, engine = cuda_tokens(path, together=together, dtype="bfloat16")
    assert isinstance(engine.model.decoder.lm_head_t, PackedMatrix) is (kind in HEAD_KINDS)
    if not together and kernels.triton is not None:
        report = engine.decoder_engine.kernel_report
        assert report["fused"] and not [name for name, r in report["products"].items() if "wrong_outputs" in r], report
    positions = [first_divergence(a, b) for a, b in zip(dense, packed)]
    print(f"{kind} {'batched' if together else 'batch 1'}: first divergence packed vs dense (None = identical): "
          f"{positions}")
    assert all(p is None or p > 0 for p in positions)


def test_a_4_bit_lm_head_stays_packed_where_the_layers_do(quantized):
    """``--lm-head int4``: the head is the step's last packed product, 4-bit in the layers' groups,
    equal to the dequantized head, counted as a step reads it; the torch CPU backend takes it dense."""
    from edgeinfer.quant.footprint import decode_weight_bytes

    packed = load_model(quantized("w4_g32_h4"), keep_packed=True).decoder.lm_head_t
    dense = load_model(quantized("w4_g32_h4"), keep_packed=False).decoder.lm_head_t
    assert isinstance(packed, PackedMatrix) and (packed.bits, packed.group_size) == (4, 32)
    assert packed.shape == tuple(dense.t().shape) and not isinstance(dense, PackedMatrix)
    assert torch.equal(torch_dense(packed, dense.dtype), dense.t())
    read = decode_weight_bytes(quantized("w4_g32_h4"))
    assert not read.tied_head and read.head == packed.nbytes  # what a step reads of it: its codes and scales


def test_a_packed_lm_head_takes_from_the_kv_budget_what_it_holds(quantized):
    """The embeddings stand beside a quantized head, which in the dense model may have been them:
    the head saves nothing and costs its packed bytes, in the engine's count and in doctor's, so a
    profile's KV pool never grows into memory a tied dense model did not leave."""
    from edgeinfer.quant.footprint import weight_footprint
    from edgeinfer.quant.packed import bytes_saved

    path = quantized("w4_g32_h4")
    decoder = load_model(path, keep_packed=True).decoder
    head = decoder.lm_head_t
    layers = [m for m in decoder.layers.modules() if isinstance(m, PackedMatrix)]
    layer_saving = sum(m.shape[0] * m.shape[1] * 2 - m.nbytes for m in layers)
    assert bytes_saved(decoder, torch.bfloat16) == layer_saving - head.nbytes
    footprint = weight_footprint(path)
    assert footprint.head_values == head.shape[0] * head.shape[1]
    # the file's packed bytes, the head's among them, against the layers' dense bytes alone
    assert footprint.saved_bytes(2) == (footprint.quantized_values - footprint.head_values) * 2 \
        - footprint.quantized_bytes
    assert weight_footprint(quantized("w4_g32")).head_values == 0  # a dense head: no such count


def test_what_packed_products_save_goes_to_the_kv_budget(quantized):
    from edgeinfer.quant.packed import bytes_saved

    model = load_model(quantized("w4_g32"), keep_packed=True)
    packed = [m for m in model.decoder.modules() if isinstance(m, PackedMatrix)]
    dense_bytes = sum(m.shape[0] * m.shape[1] * 2 for m in packed)
    saved = bytes_saved(model.decoder, torch.bfloat16)
    assert saved == dense_bytes - sum(m.nbytes for m in packed) and 0 < saved < dense_bytes
    assert bytes_saved(load_model(quantized("w4_g32"), keep_packed=False).decoder, torch.bfloat16) == 0
    config = EngineConfig(kv_budget_mb=512)
    assert config.grown_by(300 * 2**20).kv_budget_mb == 812
    assert EngineConfig(kv_budget_mb=512, num_blocks=64).grown_by(300 * 2**20).kv_budget_mb == 512  # as configured


def test_a_tile_a_compiler_refuses_is_named_and_left_out_but_a_device_fault_stops_the_tuning():
    """A tile that cannot be built on this board (a Gluon tile under another Triton, a PTX version
    its driver lacks) costs that tile, named in the report, not the tuner; a fault of the device
    itself is raised, since nothing after it would run."""
    want = torch.arange(1, 9, dtype=torch.float32).view(1, 8)
    outputs = torch.arange(8)

    def product(tile):
        if tile == "refused":
            raise RuntimeError("ptxas fatal: Unsupported .version 9.9; current version is '8.4'\nlater lines")
        return want + 1 if tile == "wrong" else want.clone()

    right, wrong = kernels.checked_tiles(["right", "refused", "wrong"], product, want, outputs)
    assert right == ["right"]
    assert wrong["refused"] == ("could not be built or run here: RuntimeError: ptxas fatal: Unsupported .version 9.9; "
                                "current version is '8.4'")
    assert wrong["wrong"] == kernels.divergence(want + 1, want, outputs)

    def faulted(tile):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        kernels.checked_tiles(["right"], faulted, want, outputs)
    # Triton words the same faults its own way; a launch it refuses leaves the context as it was.
    assert kernels.device_fault(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    assert not kernels.device_fault(RuntimeError("Triton Error [CUDA]: too many resources requested for launch"))
    # the tensor-core tiles' own refusals (kernels._REFUSED) are worded, and faults raised, the same way
    assert kernels.refusal(RuntimeError("out of shared memory\nmore")) == "RuntimeError: out of shared memory"
    with pytest.raises(RuntimeError, match="misaligned address"):
        kernels.refusal(RuntimeError("CUDA error: misaligned address"))
