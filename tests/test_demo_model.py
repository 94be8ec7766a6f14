"""The shipped demo checkpoint and the synthetic data it was trained on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edgeinfer.demo import DEMO_MODEL_DIR, recipe, synthetic

EXAMPLE_IMAGE = Path(__file__).resolve().parents[1] / "examples" / "demo.jpg"
CHECK_SEED = 4321  # neither the training stream (0) nor the evaluation set (1234)


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(DEMO_MODEL_DIR).eval()


def answer(model, processor, image: Image.Image, question: str) -> str:
    prompt = processor.apply_chat_template(recipe.user_turn(question), add_generation_prompt=True)
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def fingerprint(samples: list[synthetic.Sample]) -> list[tuple]:
    return [(s.image.size, s.image.tobytes(), s.question, s.answer, s.qtype) for s in samples]


def test_generator_repeats_per_seed_and_differs_across_seeds():
    first = fingerprint(synthetic.held_out(7, 14))
    assert first == fingerprint(synthetic.held_out(7, 14))
    assert first != fingerprint(synthetic.held_out(8, 14))
    assert fingerprint([synthetic.sample_at(0, 123)]) == fingerprint([synthetic.sample_at(0, 123)])


def test_held_out_takes_question_types_in_turn():
    samples = synthetic.held_out(3, 21)
    assert [s.qtype for s in samples] == list(synthetic.QTYPES) * 3
    assert all(min(s.image.size) >= synthetic.MIN_SIDE and max(s.image.size) <= synthetic.MAX_SIDE for s in samples)


def test_every_generated_word_is_in_the_vocabulary(processor):
    unk = processor.tokenizer.unk_token_id
    for sample in synthetic.held_out(11, 140):
        ids = processor.tokenizer(f"{sample.question} {sample.answer}", add_special_tokens=False)["input_ids"]
        assert unk not in ids, sample.question


def test_processor_squashes_to_the_square_without_cropping(processor, model):
    image = synthetic.held_out(5, 4)[3].image.resize((400, 180))  # a position question, made wide
    prompt = processor.apply_chat_template(recipe.user_turn("Which shape is on the left?"), add_generation_prompt=True)
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    spec = recipe.DemoSpec()
    assert inputs["pixel_values"].shape == (1, 3, spec.image_size, spec.image_size)
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == model.config.image_seq_length
    # Training normalizes pixels itself; it must see what the processor gives at inference.
    # (Equal under the Pillow backend; torchvision's resampling differs by a rounding here and there.)
    ours = recipe.normalize(recipe.pixels(image, spec))
    assert np.abs(ours - inputs["pixel_values"][0].numpy()).mean() < 0.02


def test_checkpoint_fits_the_wheel_budget():
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir() if p.is_file())
    assert total <= 25 * 1024 * 1024
    assert (DEMO_MODEL_DIR / "model.safetensors").is_file()


def test_checkpoint_answers_held_out_questions(model, processor):
    samples = synthetic.held_out(CHECK_SEED, 21)
    wrong = [(s.question, s.answer, got) for s in samples
             if (got := answer(model, processor, s.image, s.question)) != s.answer]
    assert len(wrong) <= 1, wrong


def test_checkpoint_answers_the_bundled_example(model, processor):
    image = Image.open(EXAMPLE_IMAGE)
    for question, expected in synthetic.DEMO_QUESTIONS.items():
        assert answer(model, processor, image, question) == expected, question
