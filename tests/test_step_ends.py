"""The fused step's two ends (``step_ends``) against what torch computes on the same inputs: the
decoder's own lookup and RoPE, and ``torch.argmax``.

Needs Triton, and a GPU or Triton's CPU interpreter (``TRITON_INTERPRET=1``). On a GPU the cos/sin
must be torch's bits; the interpreter's cos and sin are numpy's, so there they may differ from
torch's by a rounding of the last place.
"""

from __future__ import annotations

import pytest
import torch

from edgeinfer.backends.torch import step_ends
from edgeinfer.quant.launching import SplitWorkspace
from edgeinfer.testing.kernel_device import DEVICE, kernel_marks

pytestmark = kernel_marks(step_ends.triton)


def _decoder(checkpoint, family, dtype):
    from edgeinfer.models.loader import load_model

    return load_model(checkpoint(family), device=DEVICE, dtype=dtype).decoder


def _positions(cfg, rows: int) -> torch.Tensor:
    """Positions far apart, and with M-RoPE a different one on each axis (so a frequency read from
    the wrong axis shows)."""
    torch.manual_seed(0)
    far = torch.tensor([0, 1, 7, 1000, 40000, 123457])[:rows]
    if cfg.mrope_section is None:
        return far.view(rows, 1).to(DEVICE)
    return torch.stack([far, far * 3 + 11, far // 2 + 5]).view(3, rows, 1).to(DEVICE)


def _same_or_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    if DEVICE == "cuda":
        assert torch.equal(got, want), f"{(got.float() - want.float()).abs().max().item():.3e} off torch's bits"
        return
    ulp = torch.finfo(want.dtype).eps
    off = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1.0)).max().item()
    assert off <= ulp, f"{off:.3e} off, over a rounding ({ulp:.1e})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "smolvlm"])
def test_the_rows_inputs_are_the_decoder_s_lookup_and_rope(checkpoint, family, dtype):
    """Qwen2-VL's M-RoPE sections, Qwen3-VL's interleaved axes and a plain RoPE (SmolVLM): the
    embeddings exactly, and the cos/sin as ``Decoder.rope`` gives them."""
    decoder = _decoder(checkpoint, family, dtype)
    cfg = decoder.cfg
    ends = step_ends.StepEnds(decoder, SplitWorkspace(torch.device(DEVICE)))
    rows = 6
    positions = _positions(cfg, rows)
    ids = torch.randint(0, cfg.vocab_size, (rows,), device=DEVICE)
    with torch.no_grad():
        x, cos, sin = ends.inputs(ids, positions)
        want_cos, want_sin = decoder.rope(positions, dtype)
        assert torch.equal(x, decoder.embed_tokens(ids))
    _same_or_one_rounding(cos, want_cos.reshape(rows, -1))
    _same_or_one_rounding(sin, want_sin.reshape(rows, -1))
    rope_cos, rope_sin = ends.rope(positions, dtype)
    assert torch.equal(rope_cos, cos) and torch.equal(rope_sin, sin)


def _logits(rows: int, vocab: int) -> torch.Tensor:
    """Random logits with the cases an argmax can get wrong: the maximum twice in one block and in
    two blocks, in the last partial block, NaNs, and a row of nothing but -inf."""
    torch.manual_seed(1)
    logits = torch.randn(rows, vocab, device=DEVICE)
    block = step_ends.ARGMAX_BLOCK
    logits[0, [5, 17]] = 9.0  # twice in the first block: the first
    logits[1, [block + 3, 2 * block + 1]] = 9.0  # in two blocks: the earlier
    logits[2, vocab - 1] = 9.0  # in the last, partial, block
    logits[3, [block + 9, 40]] = float("nan")  # NaN over any number, the first of them
    logits[3, 7] = float("inf")
    logits[4] = float("-inf")  # nothing but -inf: the first id
    logits[5, 3 * block - 1] = 9.0  # at a block's last column
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [2, 3], ids=["positions", "mrope-positions"])
def test_the_choice_is_torch_s_argmax_and_moves_only_the_valid_rows_on(dtype, rank):
    rows, vocab = 7, 3 * step_ends.ARGMAX_BLOCK + 100
    logits = _logits(rows, vocab).to(dtype)
    workspace = SplitWorkspace(torch.device(DEVICE))
    ids = torch.full((rows,), -1, dtype=torch.long, device=DEVICE)
    start = torch.arange(rows, device=DEVICE) * 10
    positions = (start.view(rows, 1) if rank == 2 else torch.stack([start, start + 1, start + 2]).view(3, rows, 1))
    context_lens = start + 5
    valid = torch.tensor([1, 1, 0, 1, 0, 1, 1], device=DEVICE)
    want_positions = positions + valid.view(rows, 1)
    want_context = context_lens + valid
    for _ in range(2):  # the counts are left at zero: a second step (a graph's next replay) is right too
        step_ends.choose_greedy(logits, ids, workspace)
        assert ids.tolist() == logits.argmax(-1).tolist()
        assert not workspace.arrivals.any(), "every row's count must be back at zero"
    ids.fill_(-1)
    step_ends.choose_greedy(logits, ids, workspace, positions, context_lens, valid)
    assert ids.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(positions, want_positions) and torch.equal(context_lens, want_context)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_final_norm_is_the_decoder_s_norm_row_by_row(dtype):
    """``final_norm`` against ``RMSNorm`` itself: rows of scales far apart (a row normed by another's
    sum shows), a width that is not a power of two (masked columns), a weight far from one and an
    eps large beside the rows' squares. Within eight roundings of the dtype: the sum of squares is
    taken in another order than torch's mean and 1/√ is not torch's rsqrt, a few float32 roundings
    apart, so a bf16 row may round the other way, and its product with the weight again. A row
    normed by another row's sum, or a weight left out, is off by far more."""
    from edgeinfer.models.decoder import RMSNorm

    torch.manual_seed(0)
    rows, hidden = 5, 96
    norm = RMSNorm(hidden, eps=0.05).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) * 3 - 1)
    norm = norm.to(dtype)
    x = (torch.randn(rows, hidden) * torch.tensor([0.01, 0.3, 1.0, 7.0, 300.0])[:, None]).to(DEVICE, dtype)
    with torch.no_grad():
        want = norm(x).float()
        got = step_ends.final_norm(x, norm.weight, norm.eps).float()
        # rows as a strided view (every other column of a wider tensor): copied to contiguous rows
        # first, the same values
        wide = torch.zeros(rows, 2 * hidden, dtype=dtype, device=DEVICE)
        wide[:, ::2] = x
        assert torch.equal(step_ends.final_norm(wide[:, ::2], norm.weight, norm.eps).float(), got)
    assert got.shape == want.shape
    ulp = torch.finfo(dtype).eps
    off = ((got - want).abs() / want.abs().clamp(min=ulp)).max().item()
    assert off <= 8 * ulp, f"{off:.3e} off RMSNorm's outputs, over eight roundings ({8 * ulp:.1e})"


def test_moving_the_rows_on_without_their_lengths_is_refused():
    logits = torch.randn(2, 64, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="context lengths"):
        step_ends.choose_greedy(logits, ids, SplitWorkspace(torch.device(DEVICE)),
                                torch.zeros(2, 1, dtype=torch.long, device=DEVICE))


def test_the_switch_leaves_the_ends_to_torch_and_the_report_says_which_ran(checkpoint, monkeypatch):
    from edgeinfer.backends.torch.cuda_graphs import CudaGraphDecoderEngine
    from edgeinfer.models.loader import load_model
    from edgeinfer.quant.launching import STEP_ENDS_ENV

    def engine():
        return CudaGraphDecoderEngine(load_model(checkpoint("qwen2_vl"), device=DEVICE).decoder, 1, 8,
                                      compile_layers=False, take_decoder=True)

    on = engine()
    assert on.kernel_report["step_ends"] is True
    assert on.kernel_report["staged_products"] is True  # on by default: the raw file says what the tuner had
    monkeypatch.setenv(STEP_ENDS_ENV, "0")
    off = engine()
    assert off.kernel_report["step_ends"] is False and off._fused.ends.kernels is False
