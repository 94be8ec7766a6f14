"""Tiny (and benchmark-sized) random checkpoints for every supported family.

``make_checkpoint(family, out_dir, size)`` writes an ordinary Hugging Face folder:
config.json + model.safetensors from transformers' own model class, a tokenizer, the
image processor config and the family's published chat template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from edgeinfer.testing.tokenizers import build_word_tokenizer, save_chat_template

# Tiny checkpoints rotate fast with position. With a published rope_theta (1e4..1e6) and a
# 16-wide head, most rotary pairs turn by a thousandth of a radian per position, so a prompt
# laid out with rows and columns swapped, one position off, or a wrong mask would still
# give the same greedy tokens and a parity test would not see it. With theta 10 every pair
# turns by 0.13..1 rad per position (M-RoPE's row pairs 0.32..0.56, column pairs
# 0.13..0.24, so rows and columns are told apart too).
TINY_ROPE = {"rope_type": "default", "rope_theta": 10.0}
# The Qwen vision tower's axial 2-D rotary embedding, likewise (patch rows and columns).
TINY_VISION_ROPE = {"rope_type": "axial", "rope_theta": 10.0}

SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# Sizes: "tiny" for tests; larger names mirror published models' shapes for benchmarks.
SMOLVLM_SIZES = {
    "tiny": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=64, patch_size=16),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, rope_parameters=dict(TINY_ROPE)),
        scale_factor=2, longest_edge=128,
    ),
    "smolvlm-256m": dict(
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
        text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49280, rope_theta=100000.0),
        scale_factor=4, longest_edge=1024,
    ),
}


# Query and key projections are drawn this much larger than unit variance, so attention
# logits have a standard deviation of about QK_GAIN**2 instead of 1. Near-uniform attention
# averages over the whole prompt, and a tiny model then answers a long image prompt with one
# repeated token whatever the positions are; peaked attention, like a trained model's, makes
# which token sits where change what is generated.
QK_GAIN = 2.0
_QK_PROJECTION = re.compile(r"\.(q_proj|k_proj)\.(weight|bias)$")


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every weight at unit-variance scale so that greedy outputs vary from token
    to token (transformers' 0.02 init makes a tiny model repeat one token, and a parity test
    that compares constant sequences proves little); query and key projections ``QK_GAIN``
    times larger."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
            elif name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            if _QK_PROJECTION.search(name):
                param.mul_(QK_GAIN)
    return model


def _idefics3_tokenizer(vocab_size: int):
    specials = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"]
    specials += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    return build_word_tokenizer(vocab_size, specials, bos="<|im_start|>", eos="<end_of_utterance>")


def make_smolvlm(out: Path, size: str = "tiny", architecture: str = "SmolVLM", seed: int = 0) -> Path:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    spec = SMOLVLM_SIZES[size]
    tok = _idefics3_tokenizer(spec["text"]["vocab_size"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<image>", "<end_of_utterance>", "<|im_start|>", "<pad>")}
    text = dict(spec["text"], bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<end_of_utterance>"],
                pad_token_id=ids["<pad>"], tie_word_embeddings=True, max_position_embeddings=8192)
    config_cls, model_cls = ((SmolVLMConfig, SmolVLMForConditionalGeneration) if architecture == "SmolVLM"
                             else (Idefics3Config, Idefics3ForConditionalGeneration))
    config = config_cls(vision_config=spec["vision"], text_config=text, scale_factor=spec["scale_factor"],
                        image_token_id=ids["<image>"], tie_word_embeddings=True,
                        pad_token_id=ids["<pad>"])
    model = randomize(model_cls(config).eval(), seed)
    model.generation_config.eos_token_id = ids["<end_of_utterance>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    v = spec["vision"]
    SmolVLMImageProcessorPil(
        size={"longest_edge": spec["longest_edge"]}, max_image_size={"longest_edge": v["image_size"]},
        do_image_splitting=True,
    ).save_pretrained(out)
    save_chat_template(out, SMOLVLM_TEMPLATE)
    return out


# The template published with Qwen2-VL-*-Instruct (Qwen2.5-VL ships the same one).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_QWEN_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512,
                       rope_parameters={**TINY_ROPE, "mrope_section": [2, 3, 3]})
# min/max_pixels are the processor's bounds; patch 14 x merge 2 makes one image token per 28x28 pixels,
# so the tiny bounds give 16..64 tokens per image.
QWEN2_VL_SIZES = {
    "tiny": dict(
        vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, rope_parameters=dict(TINY_VISION_ROPE)),
        text=_QWEN_TINY_TEXT, tie_word_embeddings=False, min_pixels=16 * 28 * 28, max_pixels=64 * 28 * 28,
    ),
    # Tiny, with every product's K a multiple of 128 columns in two chunks at least (text 256 wide,
    # MLP 512): the shortest model the batch-1 staged products (edgeinfer.quant.staged) take.
    "tiny-k256": dict(
        vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=256, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, rope_parameters=dict(TINY_VISION_ROPE)),
        text=dict(_QWEN_TINY_TEXT, hidden_size=256, intermediate_size=512,
                  rope_parameters={**TINY_ROPE, "mrope_section": [8, 12, 12]}),
        tie_word_embeddings=False, min_pixels=16 * 28 * 28, max_pixels=64 * 28 * 28,
    ),
    "qwen2-vl-2b": dict(
        vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2),
        text=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        tie_word_embeddings=True, min_pixels=56 * 56, max_pixels=1280 * 28 * 28,
    ),
}
QWEN2_5_VL_SIZES = {
    "tiny": dict(
        # window_size 56 px = 2x2 merged patches per window, so tiny images span several windows.
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    window_size=56, fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, rope_parameters=dict(TINY_VISION_ROPE)),
        text=_QWEN_TINY_TEXT, tie_word_embeddings=True, min_pixels=16 * 28 * 28, max_pixels=64 * 28 * 28,
    ),
}


def _qwen_tokenizer(vocab_size: int):
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]
    return build_word_tokenizer(vocab_size, specials, bos=None, eos="<|im_end|>", pad="<|endoftext|>")


def make_qwen2_vl(out: Path, size: str = "tiny", architecture: str = "Qwen2-VL", seed: int = 0) -> Path:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    qwen25 = architecture == "Qwen2.5-VL"
    spec = (QWEN2_5_VL_SIZES if qwen25 else QWEN2_VL_SIZES)[size]
    tok = _qwen_tokenizer(spec["text"]["vocab_size"])
    names = ("<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in names}
    text = dict(spec["text"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    config_cls, model_cls = ((Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration) if qwen25
                             else (Qwen2VLConfig, Qwen2VLForConditionalGeneration))
    config = config_cls(vision_config=spec["vision"], text_config=text,
                        tie_word_embeddings=spec["tie_word_embeddings"],
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = randomize(model_cls(config).eval(), seed)
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    v = spec["vision"]
    Qwen2VLImageProcessorPil(
        min_pixels=spec["min_pixels"], max_pixels=spec["max_pixels"], patch_size=v["patch_size"],
        merge_size=v["spatial_merge_size"], temporal_patch_size=v["temporal_patch_size"],
    ).save_pretrained(out)
    save_chat_template(out, QWEN2_VL_TEMPLATE)
    return out


# --- Qwen3-VL ----------------------------------------------------------------------------

# The parts of the template published with Qwen3-VL-*-Instruct that a chat of text and images
# takes (its tool-call and video branches left out); the Thinking checkpoints' template ends
# the generation prompt with an open thinking span.
QWEN3_VL_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if thinking %}{{- '<think>\n' }}{%- endif %}{%- endif %}"
)

QWEN3_VL_SIZES = {
    # Three text layers and deepstack after the first two, from the tower's blocks 0 and 1 (of 3).
    "tiny": dict(
        vision=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0, 1], rope_parameters=dict(TINY_VISION_ROPE)),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512,
                  rope_parameters={**TINY_ROPE, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        tie_word_embeddings=False, min_pixels=16 * 32 * 32, max_pixels=64 * 32 * 32,
    ),
    "qwen3-vl-2b": dict(
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17]),
        text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                  max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        tie_word_embeddings=True, min_pixels=64 * 32 * 32, max_pixels=1280 * 32 * 32,
    ),
}


def make_qwen3_vl(out: Path, size: str = "tiny", seed: int = 0, thinking: bool = False) -> Path:
    """A Qwen3-VL folder; ``thinking`` gives it the Thinking variant's ``<think>`` tags and template."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = QWEN3_VL_SIZES[size]
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = build_word_tokenizer(spec["text"]["vocab_size"], specials + ["<think>", "</think>"] * thinking,
                               bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    names = ("<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in names}
    text = dict(spec["text"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    config = Qwen3VLConfig(vision_config=spec["vision"], text_config=text,
                           tie_word_embeddings=spec["tie_word_embeddings"], image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = randomize(Qwen3VLForConditionalGeneration(config).eval(), seed)
    with torch.no_grad():  # q and k are normalized per head, so their gain lives in the norms' weights
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(QK_GAIN)
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    v = spec["vision"]
    Qwen2VLImageProcessorPil(
        min_pixels=spec["min_pixels"], max_pixels=spec["max_pixels"], patch_size=v["patch_size"],
        merge_size=v["spatial_merge_size"], temporal_patch_size=v["temporal_patch_size"],
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(out)
    template = QWEN3_VL_TEMPLATE.replace("{%- if thinking %}", "{%- if true %}" if thinking else "{%- if false %}")
    save_chat_template(out, template)
    return out


# --- InternVL ------------------------------------------------------------------------------

# The parts of the template published with OpenGVLab/InternVL3-*-hf that a chat of text and
# images takes (its default system prompt and video branch left out).
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

INTERNVL_SIZES = {
    # 32-pixel tiles of 8-pixel patches: 16 patches, pixel-shuffled to 4 tokens a tile; up to 6 tiles + a thumbnail.
    "tiny": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=32, patch_size=8),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, rope_parameters=dict(TINY_ROPE)),
        image_seq_length=4, max_patches=6,
    ),
}


def make_internvl(out: Path, size: str = "tiny", seed: int = 0, text_model: str = "qwen2") -> Path:
    """An InternVL folder (transformers' native format): InternVL3 with ``text_model="qwen2"``,
    InternVL3.5 with ``"qwen3"``."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    spec = INTERNVL_SIZES[size]
    named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    tok = build_word_tokenizer(spec["text"]["vocab_size"], ["<|im_start|>", "<|im_end|>", *named.values()],
                               bos=None, eos="<|im_end|>", pad="<|endoftext|>", named=named)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<IMG_CONTEXT>")}
    text = dict(spec["text"], model_type=text_model, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    config = InternVLConfig(vision_config=spec["vision"], text_config=text, image_token_id=ids["<IMG_CONTEXT>"],
                            image_seq_length=spec["image_seq_length"], downsample_ratio=0.5,
                            tie_word_embeddings=False)
    model = randomize(InternVLForConditionalGeneration(config).eval(), seed)
    with torch.no_grad():  # a Qwen3 text model normalizes q and k per head: their gain lives in the norms
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(QK_GAIN)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    side = spec["vision"]["image_size"]
    GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True, min_patches=1,
                             max_patches=spec["max_patches"]).save_pretrained(out)
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "InternVLProcessor", "image_seq_length": spec["image_seq_length"]}))
    save_chat_template(out, INTERNVL_TEMPLATE)
    return out


# --- LLaVA-1.5 and LLaVA-NeXT ---------------------------------------------------------

# llava-hf/llava-1.5-7b-hf's published template (also llava-v1.6-vicuna's).
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# llava-hf/llava-v1.6-mistral-7b-hf's published template.
LLAVA_NEXT_MISTRAL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\n' + message['content'][0]['text'] + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'][0]['text'] + '</s> '}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

LLAVA_SIZES = {
    "tiny": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=32, patch_size=8),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, rope_parameters=dict(TINY_ROPE)),
    ),
}
LLAVA_NEXT_SIZES = {
    "tiny": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=32, patch_size=8),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, rope_parameters=dict(TINY_ROPE)),
        # (height, width) canvases, in multiples of the tower's image_size.
        grid_pinpoints=[[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]],
    ),
}


def _llava_tokenizer(vocab_size: int):
    return build_word_tokenizer(vocab_size, ["<image>"], bos="<s>", eos="</s>", add_bos=True)


def _llava_configs(spec: dict, tok, tower: str, text_model: str):
    """(vision_config, text_config, token ids) for a LLaVA-family checkpoint."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        MistralConfig,
        SiglipVisionConfig,
    )

    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<image>", "<s>", "</s>", "<pad>")}
    vision_cls = {"clip": CLIPVisionConfig, "siglip": SiglipVisionConfig}[tower]
    text_cls = {"llama": LlamaConfig, "mistral": MistralConfig}[text_model]
    extra = {"sliding_window": None} if text_model == "mistral" else {}
    text = text_cls(**spec["text"], bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                    max_position_embeddings=4096, **extra)
    return vision_cls(**spec["vision"]), text, ids


def _save_llava(model, out: Path, tok, processor) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_llava(out: Path, size: str = "tiny", seed: int = 0, *, tower: str = "clip",
               vision_feature_layer: int | list[int] = -2, vision_feature_select_strategy: str = "default") -> Path:
    """A LLaVA-1.5 folder: CLIP (or SigLIP) tower, MLP projector, Llama text model, the llava-hf processor."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    spec = LLAVA_SIZES[size]
    tok = _llava_tokenizer(spec["text"]["vocab_size"])
    vision, text, ids = _llava_configs(spec, tok, tower, "llama")
    side = spec["vision"]["image_size"]
    prefix = 1 if tower == "clip" else 0
    seq_len = (side // spec["vision"]["patch_size"]) ** 2 + prefix - int(vision_feature_select_strategy == "default")
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=ids["<image>"],
                         image_seq_length=seq_len, vision_feature_layer=vision_feature_layer,
                         vision_feature_select_strategy=vision_feature_select_strategy, pad_token_id=ids["<pad>"])
    model = randomize(LlavaForConditionalGeneration(config).eval(), seed)
    model.generation_config.eos_token_id = ids["</s>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    # Resize the shortest edge to the tower's side, then take the centre square: llava-1.5's own processing.
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok,
                               patch_size=spec["vision"]["patch_size"],
                               vision_feature_select_strategy=vision_feature_select_strategy,
                               num_additional_image_tokens=prefix, chat_template=LLAVA_TEMPLATE)
    return _save_llava(model, out, tok, processor)


def make_llava_next(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """A LLaVA-NeXT (1.6, any-res) folder: CLIP tower, Mistral text model, llava-v1.6-mistral's template."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    spec = LLAVA_NEXT_SIZES[size]
    tok = _llava_tokenizer(spec["text"]["vocab_size"])
    vision, text, ids = _llava_configs(spec, tok, "clip", "mistral")
    side = spec["vision"]["image_size"]
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=ids["<image>"],
                             image_grid_pinpoints=spec["grid_pinpoints"], vision_feature_layer=-2,
                             vision_feature_select_strategy="default", pad_token_id=ids["<pad>"])
    model = randomize(LlavaNextForConditionalGeneration(config).eval(), seed)
    model.generation_config.eos_token_id = ids["</s>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": side},
                                                 crop_size={"height": side, "width": side},
                                                 image_grid_pinpoints=spec["grid_pinpoints"])
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok,
                                   patch_size=spec["vision"]["patch_size"], vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1, chat_template=LLAVA_NEXT_MISTRAL_TEMPLATE)
    return _save_llava(model, out, tok, processor)


# --- Gemma 3 -----------------------------------------------------------------------------

# google/gemma-3-4b-it's published template.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)

# Sliding windows of 6 tokens and 16 image tokens per picture: the prompts are several
# windows long, so a window one token off, a causal image or a global layer treated as
# sliding changes the greedy tokens. The two RoPE bases differ (and rotate fast, see
# TINY_ROPE), query_pre_attn_scalar differs from head_dim, and the norms' stored weights
# sit near 0 (Gemma scales by 1 + w), so a norm without the + 1 changes everything.
GEMMA3_SIZES = {
    "tiny": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=64, patch_size=8, vision_use_head=False),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, query_pre_attn_scalar=24,
                  sliding_window=6, max_position_embeddings=8192,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                  rope_parameters={"full_attention": dict(TINY_ROPE),
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 40.0}}),
        mm_tokens_per_image=16,
    ),
    "gemma-3-4b": dict(
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    image_size=896, patch_size=14, vision_use_head=False),
        text=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=256, vocab_size=262208, query_pre_attn_scalar=256,
                  sliding_window=1024, max_position_embeddings=131072,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        mm_tokens_per_image=256,
    ),
}
GEMMA3_NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def _gemma3_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Gemma's RMSNorm weights are stored as ``w - 1``: draw them near 0, so a norm scales by
    about 1 (``randomize`` draws norm weights near 1), except the q/k norms, which scale by
    about 2 so that attention stays peaked (q/k norms undo ``QK_GAIN``). The tied embeddings
    are drawn 4x smaller: scaled by sqrt(hidden) they would otherwise outweigh every layer,
    and a token would predict itself forever."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            elif "language_model" in name and name.endswith("norm.weight") or name.endswith("mm_soft_emb_norm.weight"):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                param.mul_(0.25)
    return model


def make_gemma3(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    spec = GEMMA3_SIZES[size]
    specials = ["<start_of_turn>", "<end_of_turn>", *GEMMA3_NAMED.values()]
    tok = build_word_tokenizer(spec["text"]["vocab_size"], specials, bos="<bos>", eos="<eos>", named=GEMMA3_NAMED)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<bos>", "<eos>", "<pad>", "<end_of_turn>", *GEMMA3_NAMED.values())}
    text = Gemma3TextConfig(**spec["text"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                            pad_token_id=ids["<pad>"])
    config = Gemma3Config(vision_config=SiglipVisionConfig(**spec["vision"]), text_config=text,
                          mm_tokens_per_image=spec["mm_tokens_per_image"], image_token_index=ids["<image_soft_token>"],
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"])
    model = _gemma3_weights(randomize(Gemma3ForConditionalGeneration(config).eval(), seed), seed)
    model.generation_config.bos_token_id = ids["<bos>"]
    model.generation_config.eos_token_id = [ids["<eos>"], ids["<end_of_turn>"]]
    model.generation_config.pad_token_id = ids["<pad>"]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    side = spec["vision"]["image_size"]
    Gemma3ImageProcessorPil(size={"height": side, "width": side}).save_pretrained(out)
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": spec["mm_tokens_per_image"]}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    save_chat_template(out, GEMMA3_TEMPLATE)
    return out


BUILDERS: dict[str, Callable[..., Path]] = {
    "smolvlm": make_smolvlm,
    "idefics3": lambda out, size="tiny", seed=0: make_smolvlm(out, size, "Idefics3", seed),
    "llava": make_llava,
    "llava_next": make_llava_next,
    "qwen2_vl": make_qwen2_vl,
    "qwen2_5_vl": lambda out, size="tiny", seed=0: make_qwen2_vl(out, size, "Qwen2.5-VL", seed),
    "qwen3_vl": make_qwen3_vl,
    "internvl": make_internvl,
    "internvl_qwen3": lambda out, size="tiny", seed=0: make_internvl(out, size, seed, text_model="qwen3"),
    "qwen3_vl_thinking": lambda out, size="tiny", seed=0: make_qwen3_vl(out, size, seed, thinking=True),
    "gemma3": make_gemma3,
}


def make_checkpoint(family: str, out: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    if family not in BUILDERS:
        raise KeyError(f"no checkpoint builder for {family!r}; known: {sorted(BUILDERS)}")
    return BUILDERS[family](Path(out), size=size, seed=seed)
