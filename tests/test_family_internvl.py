"""InternVL 3 (Qwen2 text) and 3.5 (Qwen3 text) through our loader and decoder, token for
token against transformers; the prompt against transformers' ``InternVLProcessor``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.models import internvl
from tests.test_family_qwen2_vl import (
    CASES,
    CHUNKED,
    FORCED,
    MIN_DISTINCT,
    QUESTION,
    hf_generate,
)

FAMILIES = ["internvl", "internvl_qwen3"]
# QUESTION, FORCED, CASES, CHUNKED, MIN_DISTINCT: Qwen2-VL's parity settings (its one picture is
# 3 x 2 tiles + the thumbnail here).


def load_engine(path, prefill_chunk: int = 512, **kwargs) -> Engine:
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=256, prefill_chunk=prefill_chunk),
                       **kwargs)


def hf_inputs(engine: Engine, prompt_ids: list[int], images) -> dict:
    ids = torch.tensor([prompt_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        processed = engine.adapter.image_processor(images=images, crop_to_patches=True, return_tensors="pt")
        inputs["pixel_values"] = processed["pixel_values"]
    return inputs


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    done = {}

    def get(family: str, case: str) -> list[int]:
        if (family, case) not in done:
            path = checkpoint(family)
            engine = load_engine(path)
            prompt_ids = engine.submit(QUESTION, CASES[case], FORCED).prompt_ids
            done[family, case] = hf_generate(hf_model(path), hf_inputs(engine, prompt_ids, CASES[case]))
        return done[family, case]

    return get


def generate(engine: Engine, case: str) -> list[int]:
    return engine.generate(QUESTION, CASES[case], FORCED).token_ids


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoint, reference, family, case):
    engine = load_engine(checkpoint(family), **({"prefill_chunk": CHUNKED[case]} if case in CHUNKED else {}))
    tokens = generate(engine, case)
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == reference(family, case)


def plain_reshape(features: torch.Tensor, scale: float) -> torch.Tensor:
    n, side, _, channels = features.shape
    return features.reshape(n, int(side * scale), int(side * scale), int(channels / scale**2))


def test_pixel_shuffle_order_changes_the_tokens(checkpoint, reference, monkeypatch):
    """Neighbouring patches merged in another order (no transposes) would fail the parity above."""
    monkeypatch.setattr(internvl, "pixel_shuffle", plain_reshape)
    assert generate(load_engine(checkpoint("internvl")), "one_image") != reference("internvl", "one_image")


def test_positions_one_off_change_the_tokens(checkpoint, reference):
    """A gap of one position from the first image token on (RoPE sees only distances, so a shift
    of every position would change nothing)."""
    engine = load_engine(checkpoint("internvl"))
    seq = engine.submit(QUESTION, CASES["one_image"], FORCED)
    first_image = seq.prompt_ids.index(engine.adapter.image_token_id)
    seq.prompt_positions = seq.prompt_positions.clone()
    seq.prompt_positions[first_image:] += 1
    seq.next_position += 1
    assert engine.run_until_done([seq])[0].token_ids != reference("internvl", "one_image")


def test_qwen3_text_takes_its_qk_norms(checkpoint, reference):
    engine = load_engine(checkpoint("internvl_qwen3"))
    assert engine.model.decoder.cfg.qk_norm and not engine.model.decoder.cfg.qkv_bias
    for layer in engine.model.decoder.layers:
        layer.q_norm = layer.k_norm = None
    assert generate(engine, "text") != reference("internvl_qwen3", "text")


def image_only_processor(adapter):
    """transformers' InternVLProcessor without its video part, which needs torchvision.

    Expansion and tokenization stay the library's own (``InternVLProcessor.__call__`` and
    ``replace_image_token``); only the constructor is narrowed."""
    import re

    from transformers import InternVLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyInternVLProcessor(InternVLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, image_seq_length=256, **kwargs):
            ProcessorMixin.__init__(self, image_processor, tokenizer, **kwargs)
            self.image_seq_length = image_seq_length
            self.start_image_token, self.end_image_token = tokenizer.start_image_token, tokenizer.end_image_token
            self.image_token, self.video_token = tokenizer.context_image_token, tokenizer.video_token
            self.image_token_id = tokenizer.context_image_token_id
            self.multimodal_pattern = re.compile(
                f"(?P<image>{re.escape(self.image_token)})|(?P<video>{re.escape(self.video_token)})")

    return ImageOnlyInternVLProcessor(adapter.image_processor, adapter.tokenizer,
                                      image_seq_length=adapter.image_seq_length)


def test_prompt_ids_match_the_processor(checkpoint):
    engine = load_engine(checkpoint("internvl"))
    adapter = engine.adapter
    images = CASES["two_images"]
    seq = engine.submit(QUESTION, images, SamplingParams(max_new_tokens=1))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]
    text = adapter.tokenizer.apply_chat_template(messages, chat_template=adapter.checkpoint.chat_template,
                                                 tokenize=False, add_generation_prompt=True)
    expected = image_only_processor(adapter)(text=[text], images=images, return_tensors="pt")
    assert seq.prompt_ids == expected["input_ids"][0].tolist()
    tiles = [adapter.process_image(im).tensors["pixel_values"].shape[0] for im in images]
    assert tiles == [7, 7]  # 3 x 2 and 2 x 3 tiles (the grids nearest their ratios), each with a thumbnail
    assert torch.equal(torch.cat([adapter.process_image(im).tensors["pixel_values"] for im in images]),
                       expected["pixel_values"])
    assert seq.image_tokens == sum(tiles) * adapter.image_seq_length == seq.prompt_ids.count(adapter.image_token_id)


def test_a_second_question_about_the_same_image_reuses_its_blocks(checkpoint, reference):
    engine = load_engine(checkpoint("internvl"))
    images = CASES["one_image"]
    engine.generate("what is in the image ?", images, FORCED)
    second = engine.generate(QUESTION, images, FORCED)
    image_end = max(s.end for s in engine.submit("x", images).image_spans)
    assert second.cache["vision_reused"] == 1 and second.cache["prefix_tokens_reused"] >= image_end
    assert second.token_ids == reference("internvl", "one_image")


# --------------------------------------------------------------------------- ONNX Runtime


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_through_onnxruntime(checkpoint, exported_graphs, reference, monkeypatch,
                                                              family):
    _, folder = exported_graphs(family)
    monkeypatch.setenv("EDGEINFER_ENGINES", str(folder.parent.parent))
    for case in CASES:
        engine = Engine.load(checkpoint(family), backend="onnxruntime",
                             config=EngineConfig(block_size=16, num_blocks=256, profile_name=folder.name,
                                                 prefill_chunk=CHUNKED.get(case, 512)))
        assert engine.backend == "onnxruntime"
        assert type(engine.vision_engine).__name__ == "OrtVisionEngine"
        assert generate(engine, case) == reference(family, case)


def test_decoder_graph_with_qk_norms_matches_the_torch_step(exported_graphs):
    from edgeinfer.backends.onnx.export import DECODER_FILE, cpu_session
    from edgeinfer.backends.onnx.graphs import decoder_example

    model, folder = exported_graphs("internvl_qwen3")
    session = cpu_session(folder / DECODER_FILE)
    inputs = decoder_example(model.decoder, batch=2, tokens=3, context=[9, 0], block_size=4, num_blocks=16)
    with torch.no_grad():
        expected = model.decoder(**inputs)
    for got, want in zip(session.run(None, {k: v.numpy() for k, v in inputs.items()}), expected):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)
