"""Qwen3-VL through our loader and decoder, token for token against transformers.

The tiny checkpoint (``edgeinfer.testing.checkpoints.make_qwen3_vl``) rotates fast with
position, attends sharply (the gain of q and k lives in their per-head norms) and adds
deepstack features after two of its three decoder layers, so each of Qwen3-VL's own parts
decides tokens: the mutation test checks that dropping one changes them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from tests.conftest import noise_image
from tests.test_family_qwen2_vl import hf_generate, hf_inputs, processed_by_transformers

FAMILY = "qwen3_vl"
QUESTION = "how many circle are there ?"
FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
MIN_DISTINCT = 16
CHUNKED = {"two_images": 16}  # prefill chunks that cut through the images read a masked past
CASES = {
    "text": [],
    "one_image": [noise_image(120, 80, seed=1)],
    "two_images": [noise_image(120, 80, seed=1), noise_image(60, 100, seed=2)],
}


def load_engine(path, prefill_chunk: int = 512, **kwargs) -> Engine:
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=256, prefill_chunk=prefill_chunk),
                       **kwargs)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(checkpoint(FAMILY)).eval()


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    """reference(case) -> transformers' 32 greedy tokens on our prompt ids, computed once."""
    done = {}

    def get(case: str) -> list[int]:
        if case not in done:
            engine = load_engine(checkpoint(FAMILY))
            prompt_ids = engine.submit(QUESTION, CASES[case], FORCED).prompt_ids
            done[case] = hf_generate(hf_model, hf_inputs(engine, prompt_ids, CASES[case]))
        return done[case]

    return get


def generate(engine: Engine, case: str) -> list[int]:
    return engine.generate(QUESTION, CASES[case], FORCED).token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoint, reference, case):
    engine = load_engine(checkpoint(FAMILY), **({"prefill_chunk": CHUNKED[case]} if case in CHUNKED else {}))
    tokens = generate(engine, case)
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == reference(case)


def drop_deepstack(engine: Engine) -> None:
    with torch.no_grad():
        for merger in engine.model.vision.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()


def sectioned_mrope(engine: Engine) -> None:
    decoder = engine.model.decoder
    decoder.cfg = dataclasses.replace(decoder.cfg, mrope_interleaved=False)


def drop_qk_norm(engine: Engine) -> None:
    for layer in engine.model.decoder.layers:
        layer.q_norm = layer.k_norm = None


@pytest.mark.parametrize("mutation", [drop_deepstack, sectioned_mrope, drop_qk_norm])
def test_each_qwen3_part_changes_the_tokens(checkpoint, reference, mutation):
    """A decoder that missed deepstack, interleaving or the q/k norms would fail the parity above."""
    engine = load_engine(checkpoint(FAMILY))  # fresh: no vision output or prefix cached before the mutation
    mutation(engine)
    assert generate(engine, "two_images") != reference("two_images")


def test_deepstack_features_ride_in_the_image_rows(checkpoint):
    engine = load_engine(checkpoint(FAMILY))
    cfg = engine.model.decoder.cfg
    assert (cfg.deepstack_layers, cfg.qk_norm, cfg.mrope_interleaved) == (2, True, True)
    seq = engine.submit(QUESTION, CASES["one_image"], FORCED)
    image = torch.tensor(seq.prompt_ids) == engine.adapter.image_token_id
    extra = seq.prompt_embeds[:, cfg.hidden_size:]
    assert seq.prompt_embeds.shape == (seq.prompt_len, cfg.embed_width)
    assert bool((extra[~image] == 0).all()) and bool((extra[image] != 0).any())


def test_prompt_ids_and_positions_match_transformers(checkpoint, hf_model):
    engine = load_engine(checkpoint(FAMILY))
    adapter = engine.adapter
    images = CASES["two_images"]
    seq = engine.submit(QUESTION, images, SamplingParams(max_new_tokens=1))

    expected = processed_by_transformers(adapter, images, QUESTION)
    assert seq.prompt_ids == expected["input_ids"][0].tolist()
    positions, delta = hf_model.model.get_rope_index(
        expected["input_ids"], expected["mm_token_type_ids"], image_grid_thw=expected["image_grid_thw"])
    assert torch.equal(seq.prompt_positions, positions[:, 0])
    assert seq.next_position == seq.prompt_len + int(delta)
    per_image = [adapter.process_image(im).num_tokens for im in images]
    assert per_image[0] != per_image[1] and seq.image_tokens == sum(per_image)


def test_a_second_question_about_the_same_image_reuses_its_blocks(checkpoint, reference):
    """Image-hash prefix keys: the same image reuses vision and prefill (deepstack rows included);
    a different image behind the same tokens never matches."""
    engine = load_engine(checkpoint(FAMILY))
    images = CASES["one_image"]
    engine.generate("what is in the image ?", images, FORCED)
    second = engine.generate(QUESTION, images, FORCED)
    image_end = max(s.end for s in engine.submit("x", images).image_spans)
    assert second.cache["vision_reused"] == 1 and second.cache["prefix_tokens_reused"] >= image_end
    assert second.token_ids == reference("one_image")
    other = engine.generate(QUESTION, [noise_image(120, 80, seed=9)], FORCED)
    first_image_token = min(s.start for s in engine.submit("x", images).image_spans)
    assert other.cache["vision_reused"] == 0 and other.cache["prefix_tokens_reused"] <= first_image_token


def test_the_cuda_graph_engine_runs_qwen3_off_the_gpu(checkpoint, reference):
    """The graph engine's padded static steps (run eagerly off the GPU) with deepstack rows in
    prompt chunks and plain rows in decode steps (the fused Triton step needs a GPU)."""
    from tests.test_engine import bursting_engine

    engine = bursting_engine(checkpoint(FAMILY), block_size=16, prefill_chunk=16)
    assert generate(engine, "two_images") == reference("two_images")
    assert generate(engine, "text") == reference("text")
    assert not engine.decoder_engine.kernel_report["fused"]


def test_the_fused_triton_step_takes_qk_norms(checkpoint):
    """Qwen3's per-head q/k norms are in the fused step (its tokens are checked against the
    decoder in tests/test_triton_decode.py); it still refuses Gemma's layers."""
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.models.loader import load_model

    if triton_decode.triton is None:
        pytest.skip("needs Triton (`import triton` failed)")
    decoder = load_model(checkpoint(FAMILY)).decoder
    assert decoder.cfg.qk_norm
    triton_decode.FusedDecode(decoder)


# --------------------------------------------------------------------------- ONNX Runtime


def test_decoder_graph_matches_the_torch_step(checkpoint, exported_graphs):
    from edgeinfer.backends.onnx.export import DECODER_FILE, cpu_session
    from edgeinfer.backends.onnx.graphs import decoder_example

    model, folder = exported_graphs(FAMILY)
    session = cpu_session(folder / DECODER_FILE)
    for case in (dict(batch=2, tokens=1, context=[17, 4], block_size=8, num_blocks=40),
                 dict(batch=1, tokens=9, context=[5], block_size=4, num_blocks=16)):
        inputs = decoder_example(model.decoder, **case)
        assert inputs["inputs_embeds"].shape[-1] == model.decoder.cfg.embed_width
        with torch.no_grad():
            expected = model.decoder(**inputs)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers_through_onnxruntime(checkpoint, exported_graphs, reference, monkeypatch,
                                                              case):
    _, folder = exported_graphs(FAMILY)
    monkeypatch.setenv("EDGEINFER_ENGINES", str(folder.parent.parent))
    engine = Engine.load(checkpoint(FAMILY), backend="onnxruntime",
                         config=EngineConfig(block_size=16, num_blocks=256, profile_name=folder.name,
                                             prefill_chunk=CHUNKED.get(case, 512)))
    assert engine.backend == "onnxruntime"
    assert type(engine.vision_engine).__name__ == "OrtVisionEngine", "the tower and its deepstack mergers run on ORT"
    assert generate(engine, case) == reference(case)
