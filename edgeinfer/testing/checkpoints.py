"""Tiny (and benchmark-sized) random checkpoints for every supported family.

``make_checkpoint(family, out_dir, size)`` writes an ordinary Hugging Face folder:
config.json + model.safetensors from transformers' own model class, a tokenizer, the
image processor config and the family's published chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from edgeinfer.testing.tokenizers import build_word_tokenizer, save_chat_template

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
                  num_key_value_heads=2, vocab_size=512),
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


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every weight at unit-variance scale so that greedy outputs vary from token
    to token (transformers' 0.02 init makes a tiny model repeat one token, and a parity test
    that compares constant sequences proves little)."""
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
    return model


def _idefics3_tokenizer(vocab_size: int):
    specials = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"]
    specials += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    return build_word_tokenizer(vocab_size, specials, bos="<|im_start|>", eos="<end_of_utterance>")


def make_smolvlm(out: Path, size: str = "tiny", architecture: str = "SmolVLM", seed: int = 0) -> Path:
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, SmolVLMConfig,
                              SmolVLMForConditionalGeneration)
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

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


BUILDERS: dict[str, Callable[..., Path]] = {
    "smolvlm": make_smolvlm,
    "idefics3": lambda out, size="tiny", seed=0: make_smolvlm(out, size, "Idefics3", seed),
}


def make_checkpoint(family: str, out: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    if family not in BUILDERS:
        raise KeyError(f"no checkpoint builder for {family!r}; known: {sorted(BUILDERS)}")
    return BUILDERS[family](Path(out), size=size, seed=seed)
