"""Tiny random Gemma 4 checkpoints with the structure of the smallest published variant.

google/gemma-4-E2B's text model is what the tiny one copies, at small sizes: sliding layers
between global ones, global layers with their own (wider) head size and partial
"proportional" RoPE, the last layers reusing earlier layers' K/V (``num_kv_shared_layers``)
with double-wide MLPs, per-layer input embeddings, and a final logit soft-cap. Its vision
tower (patch embedder with 2-D position tables, 2-D RoPE, pooling) and its audio tower are
transformers' own classes.

The template is Gemma 4's turn format (``<|turn>role ... <turn|>``) with one ``<|image|>``
per image; it is written here, not copied from a published checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from edgeinfer.testing.checkpoints import randomize
from edgeinfer.testing.tokenizers import build_word_tokenizer, save_chat_template

GEMMA4_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<|image|>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<turn|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}"
)

NAMED = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
         "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}
SPECIALS = ["<|turn>", "<turn|>", "<|video|>", *NAMED.values()]

SLIDING, FULL = "sliding_attention", "full_attention"

# Windows of 8 tokens in a prompt of over 150 (two images of 70 tokens each), fast RoPE on both
# layer types (theta 10, see checkpoints.TINY_ROPE), global heads twice as wide as sliding
# ones with a quarter of their angles rotated, and layers 4 and 5 reading the K/V of layers
# 3 and 2: a wrong window, mask, head size, rotation or K/V source changes the tokens.
GEMMA4_SIZES = {
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, global_head_dim=32, vocab_size=512,
                  vocab_size_per_layer_input=512, hidden_size_per_layer_input=8, sliding_window=8,
                  num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                  max_position_embeddings=8192,
                  layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
                  rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10.0},
                                   FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                          "rope_theta": 10.0}}),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                    position_embedding_size=64, use_clipped_linears=True,
                    rope_parameters={"rope_type": "axial", "rope_theta": 10.0}),
        audio=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[4, 4],
                   output_proj_dims=16),
        max_soft_tokens=70,
    ),
    # google/gemma-4-E2B's text and vision shapes as its published config gives them, for
    # benchmarks (written from that config, not read from it: compare before publishing figures).
    "gemma-4-e2b": dict(
        text=dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                  num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
                  vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, sliding_window=512,
                  num_kv_shared_layers=20, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                  layer_types=[FULL if (i + 1) % 5 == 0 else SLIDING for i in range(35)]),
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                    num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                    use_clipped_linears=True),
        audio=None,
        max_soft_tokens=280,
    ),
}


def _gemma4_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The tied embeddings 4x smaller (scaled by sqrt(hidden) they would outweigh every layer),
    the layer scalars away from 1 so that a decoder that skips them is seen."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.mul_(0.25)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.7 + 0.6 * torch.rand(buffer.shape, generator=gen))
    return model


def gemma4_config(size: str = "tiny", tok=None, **text_changes):
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    spec = GEMMA4_SIZES[size]
    ids = {} if tok is None else {t: tok.convert_tokens_to_ids(t) for t in ["<bos>", "<eos>", "<pad>", *NAMED.values(),
                                                                          "<|video|>"]}
    token_ids = {} if tok is None else dict(
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"])
    text = Gemma4TextConfig(**(spec["text"] | text_changes), **token_ids)
    special = {} if tok is None else dict(
        image_token_id=ids["<|image|>"], boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
        audio_token_id=ids["<|audio|>"], boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
        video_token_id=ids["<|video|>"])
    audio = Gemma4AudioConfig(**spec["audio"]) if spec["audio"] else None
    return Gemma4Config(text_config=text, vision_config=Gemma4VisionConfig(**spec["vision"]), audio_config=audio,
                        **special)


def make_gemma4(out: Path, size: str = "tiny", seed: int = 0, **text_changes) -> Path:
    """``text_changes`` override text-config fields (``use_bidirectional_attention="vision"``,
    ``attention_k_eq_v=True``...)."""
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        Gemma4ImageProcessorPil,
    )

    spec = GEMMA4_SIZES[size]
    tok = build_word_tokenizer(spec["text"]["vocab_size"], SPECIALS, bos="<bos>", eos="<eos>", named=NAMED)
    config = gemma4_config(size, tok, **text_changes)
    model = _gemma4_weights(randomize(Gemma4ForConditionalGeneration(config).eval(), seed), seed)
    end_of_turn = tok.convert_tokens_to_ids("<turn|>")
    model.generation_config.bos_token_id = config.text_config.bos_token_id
    model.generation_config.eos_token_id = [config.text_config.eos_token_id, end_of_turn]
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    vision = spec["vision"]
    Gemma4ImageProcessorPil(patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"],
                            max_soft_tokens=spec["max_soft_tokens"]).save_pretrained(out)
    processor = {"processor_class": "Gemma4Processor", "image_seq_length": spec["max_soft_tokens"]}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    save_chat_template(out, GEMMA4_TEMPLATE)
    return out
