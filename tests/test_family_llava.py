"""LLaVA-1.5 and LLaVA-NeXT through our loader and decoder, token for token against transformers.

The reference side is transformers end to end: its processor expands the prompt and
makes the pixels, its model generates. Ours must give the same prompt ids and the same
32 greedy tokens.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.errors import ModelLoadError
from edgeinfer.models.llava import feature_layers
from edgeinfer.testing.checkpoints import make_llava
from tests.conftest import noise_image

QUESTION = "what is in the image ?"
FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
# The tiny checkpoints rotate fast with position and attend sharply (see
# edgeinfer.testing.checkpoints), so patches in the wrong order, a position one off or a
# wrong mask change these 32 tokens; a sequence with few distinct tokens would hide that.
MIN_DISTINCT = 16
# Two-image prompts are prefilled in chunks that cut through their images, so the parity
# also covers the masked attention over a past (one chunk reading the chunks before it).
CHUNKED = {"two_images": 16}
DEMO_MODEL = Path(__file__).resolve().parents[1] / "edgeinfer" / "demo_model"

CASES = {
    "llava": {
        "text": [],
        "one_image": [noise_image(50, 40, seed=1)],
        "two_images": [noise_image(40, 64, seed=2), noise_image(100, 36, seed=3)],
    },
    "llava_next": {
        "text": [],
        "wide_96x48": [noise_image(96, 48, seed=4)],  # a 1x2 grid, nothing to unpad
        "wide_unpadded": [noise_image(100, 20, seed=5)],  # a 1x3 grid, padded rows cut away
        "tall_unpadded": [noise_image(20, 100, seed=6)],  # a 3x1 grid, padded columns cut away
        "two_images": [noise_image(60, 50, seed=7), noise_image(100, 20, seed=8)],
    },
}
# LLaVA variants: several feature layers, CLS kept, a SigLIP tower without CLS.
VARIANTS = {
    "clip_layers_full": dict(tower="clip", vision_feature_layer=[-3, -1], vision_feature_select_strategy="full"),
    "siglip_full": dict(tower="siglip", vision_feature_layer=-1, vision_feature_select_strategy="full", seed=1),
}


@pytest.fixture(scope="session")
def llava_variant(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_llava(tmp_path_factory.mktemp(name), **VARIANTS[name])
        return built[name]

    return get


@cache
def engine(path: Path, prefill_chunk: int = 512) -> Engine:
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=256, prefill_chunk=prefill_chunk))


@cache
def reference(path: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


def ours(path: Path, question: str, images: list, prefill_chunk: int = 512) -> tuple[list[int], list[int]]:
    eng = engine(path, prefill_chunk)
    seq = eng.submit(question, images, FORCED)
    return seq.prompt_ids, eng.run_until_done([seq])[0].token_ids


def hf_inputs(path: Path, question: str, images: list) -> dict:
    """The processor's own prompt expansion and pixels for one user turn (images first, like ours)."""
    _, processor = reference(path)
    messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=text, images=images or None, return_tensors="pt")


def hf_generate(path: Path, inputs: dict, new_tokens: int = 32) -> list[int]:
    model, _ = reference(path)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def assert_parity(path: Path, images: list, prefill_chunk: int = 512) -> None:
    prompt_ids, tokens = ours(path, QUESTION, images, prefill_chunk)
    inputs = hf_inputs(path, QUESTION, images)
    assert prompt_ids == inputs["input_ids"][0].tolist(), "placeholder expansion differs from the processor's"
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == hf_generate(path, inputs)


@pytest.mark.parametrize("family,case", [(f, c) for f, cases in CASES.items() for c in cases])
def test_greedy_tokens_match_transformers(checkpoint, family, case):
    assert_parity(checkpoint(family), CASES[family][case], CHUNKED.get(case, 512))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_feature_layer_and_strategy_variants_match_transformers(llava_variant, variant):
    assert_parity(llava_variant(variant), CASES["llava"]["one_image"])


def test_anyres_counts_follow_the_image_shape(checkpoint):
    """Unpadding must actually remove tokens in the cases above, or they would not test it."""
    adapter = engine(checkpoint("llava_next")).adapter
    side = adapter.crop_size // adapter.patch_size
    base = side * side
    assert adapter.image_token_count(48, 96) == base + side * (2 * side + 1)
    assert adapter.image_token_count(20, 100) < base + side * (3 * side + 1)
    assert adapter.image_token_count(100, 20) < base + 3 * side * (side + 1)


@pytest.mark.parametrize("family", ["llava", "llava_next"])
@pytest.mark.parametrize("naming", ["transformers5", "hub_with_vision_model"])
def test_other_weight_namings_load_the_same_model(checkpoint, tmp_path, family, naming):
    """Checkpoints named as transformers 5 holds them in memory, or as published on the hub
    (``vision_tower.vision_model.*``), load to the same weights as the saved folder."""
    from safetensors.torch import load_file, save_file

    source = checkpoint(family)
    tensors = load_file(source / "model.safetensors")
    if naming == "transformers5":
        model, _ = reference(source)
        renamed = {k: v.contiguous() for k, v in model.state_dict().items()}
    else:
        renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    assert set(renamed) != set(tensors)
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(renamed, tmp_path / "model.safetensors")
    images = CASES[family]["two_images"]
    assert ours(tmp_path, QUESTION, images) == ours(source, QUESTION, images)


def test_feature_layer_out_of_range_is_a_load_error():
    assert feature_layers(-2, 24) == (23,)
    assert feature_layers([-3, 0, 24], 24) == (22, 0, 24)
    with pytest.raises(ModelLoadError, match="vision_feature_layer"):
        feature_layers(25, 24)


def test_demo_model_answers_like_transformers():
    """The shipped demo model, on held-out synthetic questions: same prompt, same answer up to its end token."""
    from edgeinfer.demo import synthetic

    eng = engine(DEMO_MODEL)
    for sample in synthetic.held_out(seed=1234, n=4):
        seq = eng.submit(sample.question, [sample.image], SamplingParams(max_new_tokens=16))
        tokens = eng.run_until_done([seq])[0].token_ids
        inputs = hf_inputs(DEMO_MODEL, sample.question, [sample.image])
        assert seq.prompt_ids == inputs["input_ids"][0].tolist()
        model, _ = reference(DEMO_MODEL)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        assert tokens == out[0, inputs["input_ids"].shape[1]:].tolist()
