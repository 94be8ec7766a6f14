"""The fused Triton decode kernels against plain torch on the same inputs.

Needs Triton, and a GPU or Triton's CPU interpreter: ``TRITON_INTERPRET=1 python -m pytest
tests/test_triton_decode.py`` runs the same kernels on a CPU (slowly, on smaller shapes), which
is how the kernels' indexing and the fused step's wiring are checked on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.backends.torch import triton_decode
from edgeinfer.backends.torch.decode_attention import TILING, paged_attention
from edgeinfer.models.decoder import RMSNorm, rotate_half
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.kernel_device import DEVICE, INTERPRET, kernel_marks

pytestmark = kernel_marks(triton_decode.triton)
# The interpreter runs every program in numpy: small shapes and a few tiles there.
SHAPES = [(96, 64), (40, 200)] if DEVICE == "cpu" else [(96, 64), (2048, 1536), (1536, 8960)]
CONFIGS = triton_decode.GEMV_CANDIDATES[:3] if DEVICE == "cpu" else triton_decode.GEMV_CANDIDATES
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _close(got, want, dtype):
    scale = want.float().abs().max().clamp(min=1.0)
    err = ((got.float() - want.float()).abs().max() / scale).item()
    assert err <= TOL[dtype], f"relative error {err:.2e} over {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_with_norm_bias_and_residual(dtype, m, n, k):
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5
    bias, residual = torch.randn(n, device=DEVICE, dtype=dtype), torch.randn(m, n, device=DEVICE, dtype=dtype)
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    for config in CONFIGS:
        _close(triton_decode.gemv(x, w, config=config), x @ w.t(), dtype)
        got = triton_decode.gemv(x, w, bias=bias, residual=residual, norm_weight=norm.weight, eps=norm.eps,
                                 config=config)
        _close(got, residual + ((norm(x) @ w.t()) + bias), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_glu_epilogue(dtype, m):
    """Gate row j and up row j meet in one program: outputs past a whole tile (44 of 8-row halves),
    gate and up swapped or an output paired with another's up row would fail. Against SiLU(gate)·up
    of the plain product (itself checked against torch above), rounded as the eager layer rounds."""
    torch.manual_seed(m)
    inter, k = (44, 96) if DEVICE == "cpu" else (8960, 1536)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    w = torch.randn(2 * inter, k, device=DEVICE, dtype=dtype) / k**0.5
    bias = torch.randn(2 * inter, device=DEVICE, dtype=dtype)
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    for config in CONFIGS:
        kw = {"bias": bias, "norm_weight": norm.weight, "eps": norm.eps, "config": config}
        gate_up = triton_decode.gemv(x, w, **kw)
        got = triton_decode.gemv(x, w, glu=True, **kw)
        assert got.shape == (m, inter)
        _close(got, F.silu(gate_up[:, :inter]) * gate_up[:, inter:], dtype)


def _reference_attention(qkv, cos, sin, k_pool, v_pool, tables, lens, heads, kv_heads, hd, norms=None):
    """(Per-head q/k RMSNorm,) RoPE, the past gathered from the pool plus the new token, grouped
    attention: one row at a time."""
    out, new_k, new_v = [], [], []
    bs = k_pool.shape[1]
    for row in range(qkv.shape[0]):
        q, k, v = qkv[row].split((heads * hd, kv_heads * hd, kv_heads * hd))
        q, k, v = q.view(heads, hd), k.view(kv_heads, hd), v.view(kv_heads, hd)
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        q = q * cos[row] + rotate_half(q) * sin[row]
        k = k * cos[row] + rotate_half(k) * sin[row]
        n = int(lens[row])
        slots = [int(tables[row, p // bs]) * bs + p % bs for p in range(n)]
        keys = torch.cat((k_pool.view(-1, kv_heads, hd)[slots], k[None]))  # [n + 1, kvh, hd]
        values = torch.cat((v_pool.view(-1, kv_heads, hd)[slots], v[None]))
        o = F.scaled_dot_product_attention(q[:, None].float(), keys.transpose(0, 1).float(),
                                           values.transpose(0, 1).float(), enable_gqa=True)
        out.append(o.reshape(-1))
        new_k.append(k)
        new_v.append(v)
    return torch.stack(out), torch.stack(new_k), torch.stack(new_v)


@pytest.mark.parametrize("tiling", [replace(TILING, tile=32, chunk=32), replace(TILING, tile=32, chunk=64), TILING,
                                    replace(TILING, registers=168)], ids=["tile32", "two-steps", "tile", "r168"])
@pytest.mark.parametrize("merge_values", [None, 1], ids=["merge", "merge1"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(12, 2, 128), (9, 3, 64), (4, 4, 32)])
def test_paged_attention_over_scattered_blocks(dtype, heads, kv_heads, hd, qk_norm, merge_values, tiling):
    """With steps of 32 positions (``tile32``), six splits a row of one step each; with
    ``two-steps``, three splits of two steps, the second read while the first is multiplied; with
    the default steps (and with registers capped, ``r168``), each split's one step runs past the
    row's end (masked). With ``merge1`` the last split merges the splits one at a time (a chunk of
    splits skipped, or merged before every split has written, fails)."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's CPU interpreter computes bf16 tl.dot wrongly; bf16 attention is checked on a GPU")
    if merge_values is not None:
        tiling = replace(tiling, merge_values=merge_values)
    torch.manual_seed(heads + hd)
    blocks, bs, width = 96, 16, 12
    lens = torch.tensor([0, 1, 15, 16, 77, 191], device=DEVICE)  # empty, one token, block edges, full table
    m = len(lens)
    k_pool = torch.randn(blocks, bs, kv_heads, hd, device=DEVICE, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(blocks, device=DEVICE)[:m * width].view(m, width)  # rows own their blocks
    qkv = torch.randn(m, (heads + 2 * kv_heads) * hd, device=DEVICE, dtype=dtype)
    angle = torch.rand(m, hd // 2, device=DEVICE) * 6
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1).to(dtype), torch.cat((angle.sin(), angle.sin()), -1).to(dtype)
    norms = None
    if qk_norm:  # Qwen3: each head of q and k RMSNorm'd with its own weights before RoPE
        norms = RMSNorm(hd, 1e-6).to(DEVICE, dtype), RMSNorm(hd, 1e-6).to(DEVICE, dtype)
        for norm in norms:
            norm.weight.data.uniform_(0.5, 1.5)
    want, want_k, want_v = _reference_attention(qkv, cos, sin, k_pool, v_pool, tables, lens, heads, kv_heads, hd,
                                                norms)
    qk = None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)

    new_k = torch.empty(m, kv_heads, hd, device=DEVICE, dtype=dtype)
    new_v = torch.empty_like(new_k)
    got = paged_attention(qkv, cos, sin, k_pool, v_pool, tables, lens, heads=heads, kv_heads=kv_heads, head_dim=hd,
                          new_kv=(new_k, new_v), qk_norm=qk, tiling=tiling)
    _close(got, want, dtype)
    _close(new_k, want_k, dtype)
    assert torch.equal(new_v, want_v)

    # Writing into the pool: valid rows' slot `lens` gets the new K/V, padding rows write nothing.
    valid = torch.tensor([1, 1, 1, 1, 0, 1], device=DEVICE)
    before = k_pool.clone()
    workspace = SplitWorkspace(k_pool.device)
    got_pool = paged_attention(qkv, cos, sin, k_pool, v_pool, tables, lens, heads=heads, kv_heads=kv_heads,
                               head_dim=hd, valid=valid, qk_norm=qk, workspace=workspace, tiling=tiling)
    assert torch.equal(got_pool, got)
    # the splits' counts are left at zero: the next layer (or graph replay) through them starts clean
    assert workspace.arrivals.numel() == m * kv_heads and not workspace.arrivals.any()
    changed = (k_pool != before).flatten(2).any(-1).nonzero().tolist()
    expected = sorted([int(tables[r, int(lens[r]) // bs]), int(lens[r]) % bs] for r in range(m) if valid[r])
    assert sorted(changed) == expected
    for r in range(m):
        if valid[r]:
            block, slot = int(tables[r, int(lens[r]) // bs]), int(lens[r]) % bs
            assert torch.equal(k_pool[block, slot], new_k[r])
            assert torch.equal(v_pool[block, slot], new_v[r])


def _rows_over_a_scattered_past(cfg, contexts: list[int]):
    """Random pools of 32 blocks of 4 (every layer), a table of 8 scattered blocks a row, the rows'
    contexts, one new input a row and its positions (M-RoPE's three where the family has them)."""
    torch.manual_seed(0)
    blocks, bs, m = 32, 4, len(contexts)
    k_pool = torch.randn(cfg.num_layers, blocks, bs, cfg.num_kv_heads, cfg.head_dim, device=DEVICE)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(blocks, device=DEVICE)[:8 * m].view(m, 8)
    lens = torch.tensor(contexts, device=DEVICE)
    x = torch.randn(m, 1, cfg.hidden_size, device=DEVICE)
    positions = lens.view(1, m, 1).expand(3, m, 1) if cfg.mrope_section else lens.view(m, 1)
    return k_pool, v_pool, tables, lens, x, positions, bs


@pytest.mark.parametrize("contexts", [[0], [5], [23], [23, 0, 5]], ids=["ctx0", "ctx5", "ctx23", "batch3"])
@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl", "llava", "qwen3_vl"])
def test_fused_layers_match_the_decoder_in_fp32(checkpoint, family, contexts):
    """The whole fused step (products, attention, merge, the head) against ``Decoder.forward`` on a
    tiny checkpoint, past scattered over the pool: returned K/V and K/V written in place. One row
    takes the Triton products; three rows of different contexts take the layer's own products
    around the same attention."""
    from edgeinfer.backends.torch.cuda_graphs import _relayout
    from edgeinfer.models.loader import load_model

    decoder = load_model(checkpoint(family), device=DEVICE).decoder
    cfg = decoder.cfg
    _relayout(decoder, out_major=True)
    fused = triton_decode.FusedDecode(decoder)
    k_pool, v_pool, tables, lens, x, positions, bs = _rows_over_a_scattered_past(cfg, contexts)
    m = len(contexts)
    with torch.no_grad():
        want, want_k, want_v = decoder(x, positions, k_pool, v_pool, tables, lens)
        cos, sin = decoder.rope(positions, x.dtype)
        cos, sin = cos.reshape(m, -1), sin.reshape(m, -1)
        logits, new_k, new_v = fused.layers(x[:, 0], cos, sin, k_pool, v_pool, tables, lens)
        _close(logits, want, torch.float32)
        _close(new_k, want_k, torch.float32)
        _close(new_v, want_v, torch.float32)
        pool_k, pool_v = k_pool.clone(), v_pool.clone()
        written, none_k, none_v = fused.layers(x[:, 0], cos, sin, pool_k, pool_v, tables, lens,
                                               valid=torch.ones(m, dtype=torch.long, device=DEVICE))
    assert none_k is None and none_v is None and torch.equal(written, logits)
    for row, ctx in enumerate(contexts):
        block, slot = int(tables[row, ctx // bs]), ctx % bs
        assert torch.equal(pool_k[:, block, slot], new_k[:, row, 0])
        assert torch.equal(pool_v[:, block, slot], new_v[:, row, 0])
        pool_k[:, block, slot] = k_pool[:, block, slot]
    assert torch.equal(pool_k, k_pool), "only each row's new token's slot may change"


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm"])
def test_the_few_row_layers_wire_each_fused_product_as_the_decoder_does(checkpoint, family, monkeypatch):
    """2 to 16 rows on the fused staged products (``FusedDecode.row_tiles``): each product's norm, bias,
    residual and SiLU·up go where the decoder's own layer puts them, around the same attention.
    The staged kernel needs a GPU (Gluon does not run in the interpreter), so here each product is
    torch's own (:func:`triton_decode.reference_product`, what the kernel is checked against on the
    GPU) and the wiring is what is tested: three rows of different contexts against
    ``Decoder.forward`` in fp32. A residual taken from the wrong tensor, a norm on the wrong input or
    a product left out moves the logits far past fp32's rounding."""
    from edgeinfer.backends.torch.cuda_graphs import _relayout
    from edgeinfer.models.loader import load_model
    from edgeinfer.quant.staged import StagedGemvConfig

    decoder = load_model(checkpoint(family), device=DEVICE).decoder
    cfg = decoder.cfg
    _relayout(decoder, out_major=True)
    fused = triton_decode.FusedDecode(decoder)
    called = []

    def torch_product(x, w, config, out=None, **kw):
        called.append(sorted(k for k, v in kw.items() if v is not None and v is not False))
        n = w.shape[0] // 2 if kw.get("glu") else w.shape[0]
        return triton_decode.reference_product(x, w, torch.arange(n), **kw).to(x.dtype)

    tiles = dict.fromkeys(fused.ROW_PRODUCTS, StagedGemvConfig(1))
    monkeypatch.setattr(fused, "row_tiles", lambda x: tiles if x.shape[0] > 1 else None)
    monkeypatch.setattr(fused, "_rows_product", torch_product)
    m = 3
    k_pool, v_pool, tables, lens, x, positions, _ = _rows_over_a_scattered_past(cfg, [23, 0, 5])
    with torch.no_grad():
        want, want_k, want_v = decoder(x, positions, k_pool, v_pool, tables, lens)
        cos, sin = decoder.rope(positions, x.dtype)
        logits, new_k, new_v = fused.layers(x[:, 0], cos.reshape(m, -1), sin.reshape(m, -1), k_pool, v_pool, tables,
                                            lens)
    assert len(called) == 4 * cfg.num_layers, called
    assert ["eps", "norm_weight"] == [k for k in called[0] if k != "bias"] and "residual" in called[1]
    assert "glu" in called[2] and "norm_weight" in called[2] and "residual" in called[3]
    _close(logits, want, torch.float32)
    _close(new_k, want_k, torch.float32)
    _close(new_v, want_v, torch.float32)


# --- kernels launched as programmatic dependents (Hopper and later) ------------------------------
# Each kernel of the step is launched right behind a kernel that lets it launch at once and writes
# its input 200 µs later: a kernel that read its input before waiting would read the zeros.

if triton_decode.triton is not None and DEVICE == "cuda":
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    from edgeinfer.quant.kernels import await_inputs

    @triton.jit
    def _late_copy(SRC, DST, n, ns, BLOCK: tl.constexpr):
        """DST = SRC, written ``ns`` nanoseconds after this kernel lets the next one launch."""
        await_inputs(True)
        t0 = globaltimer()
        t = t0
        while t - t0 < ns:
            t = globaltimer()
        for i in range(0, n, BLOCK):
            at = i + tl.arange(0, BLOCK)
            tl.store(DST + at, tl.load(SRC + at, mask=at < n), mask=at < n)

    @triton.jit
    def _early_copy(SRC, DST, n, BLOCK: tl.constexpr):
        """DST = SRC, read at once without waiting for the kernel before: what no kernel may do."""
        for i in range(0, n, BLOCK):
            at = i + tl.arange(0, BLOCK)
            tl.store(DST + at, tl.load(SRC + at, mask=at < n), mask=at < n)


def _dependent_launch_skip() -> str | None:
    if DEVICE != "cuda":
        return "needs a CUDA device (none, or the interpreter is on)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"dependent launch needs sm_90 or later; this GPU is sm_{major}{minor}"
    return None


def _behind_a_late_copy(fn, src: torch.Tensor) -> torch.Tensor:
    """``fn(dst)``, replayed from a CUDA graph (where the decode step's kernels run) right behind a
    kernel that lets it launch at once and copies ``src`` into ``dst`` 200 µs later (zero until then)."""
    dst = torch.zeros_like(src)
    fn(dst)  # compiled, and any workspace sized, before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dst.zero_()
        _late_copy[(1,)](src, dst, src.numel(), 200_000, BLOCK=1024, launch_pdl=True)
        out = fn(dst)
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.skipif(_dependent_launch_skip() is not None, reason=str(_dependent_launch_skip()))
def test_dependent_kernels_wait_for_their_inputs():
    from edgeinfer.quant.launching import dependent_launch
    from edgeinfer.quant.packed import PackedMatrix

    assert dependent_launch(torch.device(DEVICE))
    torch.manual_seed(0)
    dtype, n, k = torch.bfloat16, 2048, 1536
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)

    def early(src):
        dst = torch.empty_like(src)
        _early_copy[(1,)](src, dst, src.numel(), BLOCK=1024, launch_pdl=True)
        return dst

    # The set-up itself: a kernel that does not wait does read the zeros.
    assert not _behind_a_late_copy(early, x).any(), "the kernel behind the late copy did not start before it finished"
    norm = torch.rand(k, device=DEVICE, dtype=dtype) + 0.5
    w = torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5
    want = triton_decode.gemv(x, w, norm_weight=norm, eps=1e-6)
    got = _behind_a_late_copy(lambda x: triton_decode.gemv(x, w, norm_weight=norm, eps=1e-6), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device=DEVICE)
    scales = (torch.rand(n, k // 128, device=DEVICE) * 0.01 + 0.001).to(dtype)
    packed = PackedMatrix(codes, scales, None, 4, 128, (n, k))
    workspace = SplitWorkspace(x.device)
    for config in (triton_decode.PackedGemvConfig(16, 512, 2), triton_decode.PackedGemvConfig(8, 512, 4, 3)):
        want = triton_decode.packed_gemv(x, packed, config, norm_weight=norm, eps=1e-6, workspace=workspace)
        got = _behind_a_late_copy(lambda x: triton_decode.packed_gemv(x, packed, config, norm_weight=norm, eps=1e-6,
                                                                      workspace=workspace), x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    heads, kv_heads, hd, blocks, bs = 12, 2, 128, 80, 16
    k_pool = torch.randn(blocks, bs, kv_heads, hd, device=DEVICE, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(blocks, device=DEVICE)[:64].view(1, 64)
    lens = torch.tensor([1000], device=DEVICE)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * hd, device=DEVICE, dtype=dtype)
    cos, sin = torch.rand(1, hd, device=DEVICE, dtype=dtype), torch.rand(1, hd, device=DEVICE, dtype=dtype)
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=hd)
    new_kv = torch.empty(1, kv_heads, hd, device=DEVICE, dtype=dtype), torch.empty(1, kv_heads, hd, device=DEVICE,
                                                                                   dtype=dtype)
    # 1,000 positions: 8 splits, the last of each KV head's to arrive merging them
    kw["workspace"] = SplitWorkspace(x.device)
    want = paged_attention(qkv, cos, sin, k_pool, v_pool, tables, lens, new_kv=new_kv, **kw)
    got = _behind_a_late_copy(lambda qkv: paged_attention(qkv, cos, sin, k_pool, v_pool, tables, lens, new_kv=new_kv,
                                                          **kw), qkv)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="the interpreter rounds bf16 by truncation, 2-4 units off round-to-nearest after a norm "
                      "and SiLU·up: bf16 is checked on a GPU (the bounds against rounding to nearest: "
                      "test_quant_packed's test_the_check_s_bounds_hold_for_the_kernels_arithmetic)"))])
@pytest.mark.parametrize("weights", ["dense", "w4 zeros", "w8"])
@pytest.mark.parametrize("fused", ["norm bias glu", "residual"])
def test_the_step_s_tiles_are_checked_against_torch_and_a_wrong_one_is_named(dtype, weights, fused):
    """Before the fused step times a tile it checks the tile's outputs against
    :func:`triton_decode.reference_product` (torch, rounded as the kernels round): every kernel's tile
    passes, dense and packed, with the prologue and epilogues the step fuses; a tile that moves one
    output, or pairs a gate with another output's up row, is refused with where."""
    from edgeinfer.quant.packed import PackedMatrix

    torch.manual_seed(5)
    n, k = (96, 256) if DEVICE == "cpu" else (17920, 1536)
    if weights == "dense":
        w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
        tiles = CONFIGS
    else:
        bits = 4 if weights.startswith("w4") else 8
        codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), dtype=torch.int32, device=DEVICE)
        group = 128 if bits == 4 else k
        scales = (torch.rand(n, k // group, device=DEVICE) * 0.02 + 0.001).to(dtype)
        zeros = torch.randint(0, 16, (n, k // group), device=DEVICE).to(dtype) if "zeros" in weights else None
        w = PackedMatrix(codes, scales, zeros, bits, group, (n, k))
        tiles = triton_decode.PACKED_GEMV_CANDIDATES[:3] if DEVICE == "cpu" else triton_decode.PACKED_GEMV_CANDIDATES
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    if fused == "residual":
        kw = {"residual": torch.randn(1, n, device=DEVICE, dtype=dtype)}
    else:
        kw = {"bias": torch.randn(n, device=DEVICE, dtype=dtype), "eps": 1e-6, "glu": True,
              "norm_weight": torch.empty(k, device=DEVICE, dtype=dtype).uniform_(0.5, 1.5)}
    out = torch.empty(1, n // 2 if kw.get("glu") else n, device=DEVICE, dtype=dtype)
    workspace = SplitWorkspace(torch.device(DEVICE))

    def run(x, w, tile, **kw):
        if isinstance(w, PackedMatrix):
            return triton_decode.packed_gemv(x, w, tile, workspace=workspace, **kw)
        return triton_decode.gemv(x, w, config=tile, **kw)

    right, wrong = triton_decode.right_tiles(x, w, tiles, out, run, **kw)
    assert right == list(tiles) and wrong == {}

    def one_tile_wrong(x, w, tile, **kw):
        y = run(x, w, tile, **kw)
        if tile == tiles[1]:  # the last output (the tile cut short at N's end), moved past any bound
            y[0, -1] += 2 * y.abs().max()
        return y

    right, wrong = triton_decode.right_tiles(x, w, tiles, out, one_tile_wrong, **kw)
    assert right == [tiles[0], *tiles[2:]]
    assert wrong[triton_decode._config_name(tiles[1])].startswith(f"row 0, output {out.shape[1] - 1}:")
    if kw.get("glu"):  # SiLU(gate)·up with each gate paired with the next output's up row
        def shifted_up(x, w, tile, **kw):
            half = w.shape[0] // 2
            order = torch.cat([torch.arange(half), half + torch.arange(half).roll(-1)]).to(DEVICE)
            moved = (PackedMatrix(w.codes[order], w.scales[order], None if w.zeros is None else w.zeros[order],
                                  w.bits, w.group_size, tuple(w.shape)) if isinstance(w, PackedMatrix) else w[order])
            return run(x, moved, tile, **{**kw, "bias": kw["bias"][order]})

        right, wrong = triton_decode.right_tiles(x, w, tiles[:1], out, shifted_up, **kw)
        assert right == [] and list(wrong) == [triton_decode._config_name(tiles[0])]
