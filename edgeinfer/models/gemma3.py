"""Gemma 3: a SigLIP tower, an average-pool projector, and Gemma's text model.

Every image (and, with pan-and-scan, each of its crops) is resized to the tower's square
side and becomes ``mm_tokens_per_image`` tokens: the tower's patch grid is average-pooled
down to ``sqrt(mm_tokens_per_image)`` per side, RMS-normed (Gemma's ``1 + w`` norm) and
projected. The published chat template emits ``<start_of_image>`` per image; as
transformers' processor does, it becomes ``\\n\\n<start_of_image>`` + the image tokens +
``<end_of_image>\\n\\n``, and with pan-and-scan the original image's sequence is followed by
one such sequence per crop, between the processor's own words.

The text model differs from Llama in ways the decoder takes as fields of
:class:`DecoderConfig`: RMSNorm scaling by ``1 + w`` (around attention and MLP outputs
too, and per head on q and k), GELU-tanh, embeddings scaled by ``sqrt(hidden)``, the
softmax scale ``query_pre_attn_scalar ** -0.5``, sliding-window layers (with their own
RoPE base) between global ones, and each image's tokens attending to each other in both
directions while text stays causal. Positions are plain 1-D.
"""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.models.base import (
    FamilyAdapter,
    ImageInputs,
    PromptLayout,
    load_module_state,
)
from edgeinfer.models.decoder import (
    Decoder,
    DecoderConfig,
    load_decoder_weights,
    rope_inv_freq,
)
from edgeinfer.models.export import VisionGraph
from edgeinfer.models.llava import finish_vision

# transformers 5 saves the in-memory names; hub checkpoints carry the older ones.
_RENAMES = (
    (r"^model\.vision_tower\.(vision_model\.)?", "vision.tower."),
    (r"^model\.multi_modal_projector\.", "vision.projector."),
    (r"^model\.language_model\.", "text."),
    (r"^vision_tower\.(vision_model\.)?", "vision.tower."),
    (r"^multi_modal_projector\.", "vision.projector."),
    (r"^language_model\.model\.", "text."),
    (r"^language_model\.lm_head\.", "text.lm_head."),
    (r"^lm_head\.", "text.lm_head."),
)

SLIDING = "sliding_attention"
FULL = "full_attention"


class Gemma3VisionEncoder(nn.Module):
    """Pictures ``[n, 3, side, side]`` (an image and its crops) -> ``[n * mm_tokens, text_hidden]``."""

    def __init__(self, tower: nn.Module, projector: nn.Module) -> None:
        super().__init__()
        self.tower = tower
        self.projector = projector

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.projector.mm_input_projection_weight.dtype
        features = self.tower(pixel_values=pixel_values.to(dtype)).last_hidden_state
        return self.projector(features).flatten(0, 1)


def image_runs(token_ids: list[int], image_token_id: int) -> torch.Tensor:
    """[T] index of the run of consecutive image tokens each token is in, -1 for text: the
    groups that attend to each other (transformers' ``get_block_sequence_ids_for_mask``)."""
    is_image = torch.tensor(token_ids, dtype=torch.long) == image_token_id
    starts = is_image & ~torch.cat((torch.zeros(1, dtype=torch.bool), is_image[:-1]))
    return torch.where(is_image, starts.long().cumsum(0) - 1, -1)


class Gemma3Adapter(FamilyAdapter):
    architectures = ("Gemma3ForConditionalGeneration",)
    weight_renames = _RENAMES

    @property
    def image_marker(self) -> str:
        return self.tokenizer.boi_token

    @property
    def image_token_id(self) -> int:
        return int(self.config.image_token_id)

    @property
    def tokens_per_picture(self) -> int:
        return int(self.config.mm_tokens_per_image)

    @property
    def patches_per_token(self) -> int:
        vision = self.config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // self.tokens_per_picture

    # --- text side -----------------------------------------------------------------
    def decoder_config(self) -> DecoderConfig:
        text = self.text_config
        layer_types = tuple(text.layer_types)
        unknown = set(layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported; known: {[SLIDING, FULL]}")
        heads = text.num_attention_heads
        return DecoderConfig(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers, num_heads=heads, num_kv_heads=text.num_key_value_heads or heads,
            head_dim=text.head_dim, rms_norm_eps=text.rms_norm_eps, qkv_bias=bool(text.attention_bias),
            o_bias=bool(text.attention_bias), mlp_bias=False,
            tie_word_embeddings=bool(getattr(self.config, "tie_word_embeddings", True)),
            norm_offset=1.0, sandwich_norms=True, qk_norm=True, hidden_act=text.hidden_activation,
            embed_scale=float(text.hidden_size) ** 0.5, attn_scale=float(text.query_pre_attn_scalar) ** -0.5,
            sliding_window=text.sliding_window,
            sliding_layers=tuple(t == SLIDING for t in layer_types), bidirectional_images=True,
        )

    def build_decoder(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Decoder:
        inv_freq, scaling = rope_inv_freq(self.text_config, FULL)
        local_freq, local_scaling = rope_inv_freq(self.text_config, SLIDING)
        with torch.device("meta"):
            decoder = Decoder(self.decoder_config(), inv_freq.to("meta"), scaling, (local_freq.to("meta"), local_scaling))
        decoder = decoder.to_empty(device="cpu").to(dtype)
        decoder.inv_freq, decoder.local_inv_freq = inv_freq.float(), local_freq.float()
        load_decoder_weights(decoder, tensors)
        return decoder.eval()

    def stop_token_ids(self) -> tuple[int, ...]:
        ids = list(super().stop_token_ids())
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id and end_of_turn not in ids:
            ids.append(end_of_turn)  # the template closes every turn with it
        return tuple(ids)

    def layout(self, token_ids: list[int], images: list[ImageInputs]) -> PromptLayout:
        n = len(token_ids)
        return PromptLayout(token_ids, torch.arange(n), n, self.image_token_id,
                            attend_groups=image_runs(token_ids, self.image_token_id))

    # --- vision side ---------------------------------------------------------------
    def build_vision(self, tensors, dtype):
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        with torch.device("meta"):
            tower = AutoModel.from_config(self.config.vision_config)
            projector = Gemma3MultiModalProjector(self.config)
        return finish_vision(load_module_state(Gemma3VisionEncoder(tower, projector), tensors, dtype))

    def vision_graph(self, vision):
        """The tower and projector as they are: pictures (an image and its crops) in, tokens out."""
        return VisionGraph(vision, ("pixel_values",), "pictures")

    def image_kwargs(self) -> dict:
        """Gemma3Processor's image settings: its defaults (pan-and-scan off), then the
        pan-and-scan keys of the checkpoint's processor_config.json. transformers takes those
        only as call arguments (``processor(..., do_pan_and_scan=True)``); here the folder says."""
        defaults = {k: v for k, v in processor_image_defaults().items() if k.startswith(("do_pan", "pan_and"))}
        return defaults | {k: v for k, v in self.checkpoint.processor_config.items() if k in defaults}

    def process_image(self, image) -> ImageInputs:
        out = self.image_processor(images=[image], return_tensors="pt", **self.image_kwargs())
        crops = int(out["num_crops"][0])
        pictures = out["pixel_values"]
        return ImageInputs(tensors={"pixel_values": pictures}, num_tokens=pictures.shape[0] * self.tokens_per_picture,
                           placeholder=self.placeholder(crops))

    def placeholder(self, crops: int) -> str:
        """The text transformers' Gemma3Processor puts where the template's ``<start_of_image>`` was."""
        tok = self.tokenizer
        one = f"\n\n{tok.boi_token}{tok.image_token * self.tokens_per_picture}{tok.eoi_token}\n\n"
        if not crops:
            return one
        return f"Here is the original image {one} and here are some crops to help you see better " + " ".join(
            [one] * crops)

    def image_limits(self):
        return {"max_side": None, "max_pixels": None, "min_side": None}



def processor_image_defaults() -> dict:
    """Gemma3Processor's default image settings: a class attribute in recent transformers 5
    releases, the processor's kwargs class's ``_defaults`` in earlier ones (5.17)."""
    from transformers import Gemma3Processor

    defaults = getattr(Gemma3Processor, "images_kwargs", None)
    if defaults is None:
        from transformers.models.gemma3.processing_gemma3 import Gemma3ProcessorKwargs

        defaults = Gemma3ProcessorKwargs._defaults["images_kwargs"]
    return dict(defaults)
