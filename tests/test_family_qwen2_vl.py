"""Qwen2-VL / Qwen2.5-VL through our loader and decoder, token for token against transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.engine.inputs import expand_images, tokenize
from edgeinfer.errors import RequestError
from tests.conftest import noise_image

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
QUESTION = "how many circle are there ?"
FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
# The tiny checkpoints rotate fast with position and attend sharply (see
# edgeinfer.testing.checkpoints), so image rows and columns swapped, a position one off or a
# wrong mask change these 32 tokens; a sequence with few distinct tokens would hide that.
MIN_DISTINCT = 16
# The two-image prompt is prefilled in chunks that cut through its images, so the parity
# also covers the masked attention over a past (one chunk reading the chunks before it).
CHUNKED = {"two_images": 16}
CASES = {
    "text": [],
    "one_image": [noise_image(120, 80, seed=1)],
    "two_images": [noise_image(120, 80, seed=1), noise_image(60, 100, seed=2)],
}


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    """reference(family, case) -> (our prompt ids, transformers' greedy tokens on them), computed once."""
    done = {}

    def get(family: str, case: str):
        if (family, case) not in done:
            path = checkpoint(family)
            engine = load_engine(path)
            prompt_ids = engine.submit(QUESTION, CASES[case], FORCED).prompt_ids
            inputs = hf_inputs(engine, prompt_ids, CASES[case])
            done[family, case] = prompt_ids, hf_generate(hf_model(path), inputs)
        return done[family, case]

    return get


def load_engine(path, prefill_chunk: int = 512) -> Engine:
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=256, prefill_chunk=prefill_chunk))


def hf_inputs(engine: Engine, prompt_ids: list[int], images) -> dict:
    ids = torch.tensor([prompt_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        processed = engine.adapter.image_processor(images=images, return_tensors="pt")
        inputs |= {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"],
                   "mm_token_type_ids": (ids == engine.adapter.image_token_id).int()}
    return inputs


def hf_generate(model, inputs: dict, new_tokens: int = 32) -> list[int]:
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoint, reference, family, case):
    engine = load_engine(checkpoint(family), **({"prefill_chunk": CHUNKED[case]} if case in CHUNKED else {}))
    seq = engine.submit(QUESTION, CASES[case], FORCED)
    tokens = engine.run_until_done([seq])[0].token_ids
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == reference(family, case)[1]


def test_batched_chunked_prefill_keeps_each_sequences_positions(checkpoint, reference):
    """Sequences with different rope deltas decode in one batch; prefill chunks cut through images."""
    engine = Engine.load(checkpoint("qwen2_vl"), config=EngineConfig(block_size=16, num_blocks=256,
                                                                     prefill_chunk=16))
    seqs = [engine.submit(QUESTION, CASES[case], FORCED) for case in CASES]
    results = engine.run_until_done(seqs)
    assert [r.token_ids for r in results] == [reference("qwen2_vl", case)[1] for case in CASES]


def image_only_processor(image_processor, tokenizer):
    """transformers' Qwen2VLProcessor without its video part, which needs torchvision.

    Expansion and tokenization stay the library's own (``ProcessorMixin.__call__`` with
    ``Qwen2VLProcessor.replace_image_token``); only the constructor is narrowed.
    """
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, **kwargs)

    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer)


def processed_by_transformers(adapter, images, question=QUESTION):
    """transformers' processor output for the chat template's prompt of ``question`` over ``images``."""
    processor = image_only_processor(adapter.image_processor, adapter.tokenizer)
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    text = adapter.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                 chat_template=adapter.checkpoint.chat_template,
                                                 tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=images, return_tensors="pt")


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_layout_matches_transformers(checkpoint, hf_model, family):
    path = checkpoint(family)
    engine = load_engine(path)
    adapter = engine.adapter
    images = CASES["two_images"]
    seq = engine.submit(QUESTION, images, SamplingParams(max_new_tokens=1))

    expected = processed_by_transformers(adapter, images, QUESTION)
    assert seq.prompt_ids == expected["input_ids"][0].tolist()

    positions, delta = hf_model(path).model.get_rope_index(
        expected["input_ids"], expected["mm_token_type_ids"], image_grid_thw=expected["image_grid_thw"])
    assert torch.equal(seq.prompt_positions, positions[:, 0])
    assert seq.next_position == seq.prompt_len + int(delta)

    merge = adapter.image_processor.merge_size
    per_image = [adapter.image_processor.get_number_of_image_patches(im.height, im.width) // merge**2
                 for im in images]
    assert [adapter.process_image(im).num_tokens for im in images] == per_image
    assert seq.image_tokens == sum(per_image) == seq.prompt_ids.count(adapter.image_token_id)
    assert per_image[0] != per_image[1], "images of different sizes should give different grids"


def in_memory_weight_names(folder, model) -> None:
    """Weights under transformers' module names (``model.visual.*``, ``model.language_model.*``)."""
    from safetensors.torch import save_file

    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    assert any(name.startswith("model.language_model.") for name in state)
    save_file(state, folder / "model.safetensors")


def flat_hub_config(folder, model) -> None:
    """config.json as the hub publishes Qwen2-VL: text fields at the top, ``rope_scaling`` of type mrope."""
    config = json.loads((folder / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config |= {k: v for k, v in text.items() if k not in ("model_type", "layer_types", "dtype")}
    config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    config["rope_theta"] = rope["rope_theta"]
    config["vision_config"]["model_type"] = "qwen2_vl"
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("rewrite", [in_memory_weight_names, flat_hub_config])
def test_other_checkpoint_layouts_load_the_same_model(checkpoint, hf_model, reference, tmp_path, rewrite):
    path = checkpoint("qwen2_vl")
    folder = tmp_path / "rewritten"
    shutil.copytree(path, folder)
    rewrite(folder, hf_model(path))
    tokens = load_engine(folder).generate(QUESTION, CASES["one_image"], FORCED).token_ids
    assert tokens == reference("qwen2_vl", "one_image")[1]


def test_limits_and_stop_tokens_come_from_the_checkpoint(checkpoint):
    adapter = load_engine(checkpoint("qwen2_5_vl")).adapter
    limits = adapter.image_limits()
    assert (limits["max_pixels"], limits["min_pixels"], limits["min_side"]) == (64 * 28 * 28, 16 * 28 * 28, 28)
    # generation_config.json lists <|endoftext|> next to <|im_end|>; transformers stops on both.
    ids = adapter.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(adapter.stop_token_ids()) == set(ids)


def test_a_prompt_whose_image_tokens_miss_its_images_is_refused(checkpoint):
    adapter = load_engine(checkpoint("qwen2_vl")).adapter
    image = adapter.process_image(noise_image(120, 80, seed=1))
    marker = adapter.image_marker
    text = expand_images(f"<|vision_start|>{marker}<|vision_end|>how many?", marker, [image])
    assert tokenize(adapter, text, [image]).token_ids.count(adapter.image_token_id) == image.num_tokens
    with pytest.raises(RequestError, match=f"has {image.num_tokens - 1} image tokens where the images need "
                                           f"{image.num_tokens}"):
        tokenize(adapter, text.replace(marker, "", 1), [image])
