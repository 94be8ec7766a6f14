"""How the demo checkpoint is put together: its sizes, tokenizer, processor and prompt.

The checkpoint is an ordinary LLaVA folder (CLIP vision tower, two-layer MLP projector,
Llama text model) so transformers loads it as well as edgeinfer. ``DemoSpec`` holds
every size; ``build_tokenizer``, ``build_processor`` and ``build_model`` turn it into
the transformers objects that training fills and ``save_pretrained`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from . import synthetic

PAD, UNK, BOS, EOS, IMAGE = "<pad>", "<unk>", "<s>", "</s>", "<image>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, IMAGE)
# Words of the prompt frame and punctuation, beside the generator's own words.
FRAME_WORDS = ("user", "assistant", ":", "?", ".", ",", "!", "'", "-")
# Letters so that an unknown word still splits into something other than one <unk>.
LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Images first, then the text, whatever order the content parts come in: that is the
# only layout the model was trained on. A system turn is ignored.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "USER: "
    "{%- if message['content'] is string -%}{{ ' ' + message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{ ' <image>\n' }}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ ' ' + part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ ' ASSISTANT: ' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{{ eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' ASSISTANT:' }}{%- endif -%}"
)


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """Every size of the demo model; the defaults are the shipped checkpoint."""

    image_size: int = 128
    patch_size: int = 16
    vision_hidden: int = 160
    vision_layers: int = 4
    vision_heads: int = 5
    vision_mlp: int = 640
    text_hidden: int = 256
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    text_mlp: int = 512
    max_positions: int = 256

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.vision_hidden % self.vision_heads or self.text_hidden % self.text_heads:
            raise ValueError("hidden sizes must be multiples of their head counts")
        if self.text_heads % self.text_kv_heads:
            raise ValueError(f"text_heads {self.text_heads} is not a multiple of text_kv_heads {self.text_kv_heads}")

    @property
    def image_tokens(self) -> int:
        """Image embeddings per picture: one per patch (the CLS token is dropped)."""
        return (self.image_size // self.patch_size) ** 2


def vocabulary() -> list[str]:
    """Token strings in id order: specials first, then frame words, letters and the generator's words."""
    words = [w for w in (*FRAME_WORDS, *LETTERS, *synthetic.vocabulary()) if w not in SPECIAL_TOKENS]
    return list(SPECIAL_TOKENS) + list(dict.fromkeys(words))


def build_tokenizer():
    """A word-level fast tokenizer over :func:`vocabulary`, lower-casing, wrapped for transformers."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        model_max_length=DemoSpec().max_positions,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    return tokenizer


def build_image_processor(spec: DemoSpec):
    """Resize to the fixed square (no crop: position questions need the whole picture)."""
    try:  # the Pillow backend, which needs no torchvision (transformers >= 5)
        from transformers.models.clip import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    side = {"height": spec.image_size, "width": spec.image_size}
    return ImageProcessor(
        do_resize=True, size=side, resample=Image.BICUBIC,
        do_center_crop=False, crop_size=side,
        do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD),
        do_convert_rgb=True,
    )


def build_processor(spec: DemoSpec):
    from transformers import LlavaProcessor

    return LlavaProcessor(
        image_processor=build_image_processor(spec),
        tokenizer=build_tokenizer(),
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
        chat_template=CHAT_TEMPLATE,
    )


def build_config(spec: DemoSpec, tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=spec.vision_mlp,
        num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
        image_size=spec.image_size, patch_size=spec.patch_size, num_channels=3,
        hidden_act="quick_gelu", projection_dim=spec.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=spec.text_mlp,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        image_seq_length=spec.image_tokens,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )


def build_model(spec: DemoSpec, tokenizer):
    from transformers import GenerationConfig, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(build_config(spec, tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=8,
    )
    return model


def pixels(image: Image.Image, spec: DemoSpec) -> np.ndarray:
    """``image`` resized to the model's square as uint8 ``[H, W, 3]``, exactly as the processor resizes it.

    Training normalizes these on its device; :func:`normalize` does it on the host.
    """
    resized = image.convert("RGB").resize((spec.image_size, spec.image_size), Image.BICUBIC)
    return np.asarray(resized, dtype=np.uint8)


def normalize(rgb: np.ndarray) -> np.ndarray:
    """uint8 ``[..., H, W, 3]`` to the processor's float32 ``[..., 3, H, W]``."""
    scaled = rgb.astype(np.float32) / 255.0
    normalized = (scaled - np.array(CLIP_MEAN, dtype=np.float32)) / np.array(CLIP_STD, dtype=np.float32)
    return np.moveaxis(normalized, -1, -3)


def user_turn(question: str) -> list[dict]:
    """The chat messages of one question about one image, as the chat template takes them."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
