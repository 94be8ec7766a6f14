"""SmolVLM / Idefics3 through our loader and decoder, token for token against transformers."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from tests.conftest import noise_image

FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
# The tiny checkpoints rotate fast with position and attend sharply (see
# edgeinfer.testing.checkpoints), so tiles or their tokens in the wrong order, a position one
# off or a wrong mask change these 32 tokens; a sequence with few distinct tokens would hide that.
MIN_DISTINCT = 16
# The two-image prompt is prefilled in chunks that cut through its images, so the parity
# also covers the masked attention over a past (one chunk reading the chunks before it).
CHUNKED = {"two_images": 16}


def hf_generate(path, prompt_ids, images, new_tokens=32):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    kwargs = {}
    if images:
        processed = AutoImageProcessor.from_pretrained(path)(images=[images], return_tensors="pt")
        kwargs = {"pixel_values": processed["pixel_values"], "pixel_attention_mask": processed["pixel_attention_mask"]}
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def ours(path, question, images, block_size=16, prefill_chunk=512):
    engine = Engine.load(path, config=EngineConfig(block_size=block_size, num_blocks=4096 // block_size,
                                                   prefill_chunk=prefill_chunk))
    seq = engine.submit(question, images, FORCED)
    result = engine.run_until_done([seq])[0]
    return seq.prompt_ids, result.token_ids


CASES = {
    "text": [],
    "one_image": [noise_image(128, 96, seed=1)],
    "two_images": [noise_image(64, 64, seed=2), noise_image(100, 128, seed=3)],
}


@pytest.mark.parametrize("family", ["smolvlm", "idefics3"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoint, family, case):
    path = checkpoint(family)
    prompt_ids, tokens = ours(path, "what is in the image ?", CASES[case], prefill_chunk=CHUNKED.get(case, 512))
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == hf_generate(path, prompt_ids, CASES[case])


def test_placeholder_expansion_matches_transformers_processor(checkpoint):
    from transformers import AutoImageProcessor, AutoTokenizer, Idefics3Processor

    path = checkpoint("smolvlm")
    engine = Engine.load(path, config=EngineConfig(num_blocks=64))
    images = CASES["two_images"]
    seq = engine.submit("what is in the image ?", images, SamplingParams(max_new_tokens=1))
    # SmolVLM's own processor needs torchvision for its video part; Idefics3's shares the image layout.
    Idefics3Processor.image_processor_class = "AutoImageProcessor"
    processor = Idefics3Processor(AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                                  image_seq_len=engine.adapter.image_seq_len,
                                  chat_template=engine.adapter.checkpoint.chat_template)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "what is in the image ?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    expected = processor(text=text, images=[images], return_tensors="pt")["input_ids"][0].tolist()
    assert seq.prompt_ids == expected
