"""InternVL 3 / 3.5 in transformers' native format: an InternViT tower, pixel shuffle, a
two-layer projector, a Qwen2 (InternVL3) or Qwen3 (InternVL3.5) text model.

The image processor (GOT-OCR2's) cuts an image into tower-sized tiles on the grid of at most
``max_patches`` tiles whose aspect ratio is closest to the image's, plus a thumbnail of the
whole image where there is more than one tile. Each tile's patch features (CLS dropped,
from ``vision_feature_layer``) are pixel-shuffled: every 2 x 2 block of patches becomes one
feature of four times the width (``downsample_ratio`` 0.5), then projected. So a tile is
``image_seq_length`` tokens, and the chat template's ``<IMG_CONTEXT>`` for an image expands
to ``<img>`` + ``<IMG_CONTEXT>`` x (tiles x ``image_seq_length``) + ``</img>``, as
transformers' ``InternVLProcessor`` does. Positions are plain 1-D.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from edgeinfer.errors import ModelLoadError
from edgeinfer.models.base import FamilyAdapter, ImageInputs, load_module_state
from edgeinfer.models.decoder import DecoderConfig
from edgeinfer.models.export import VisionGraph
from edgeinfer.models.llava import feature_layers

# transformers 5's in-memory names first, then the names the hub's -hf checkpoints are saved with.
_RENAMES = (
    (r"^model\.vision_tower\.", "vision.tower."),
    (r"^model\.multi_modal_projector\.", "vision.projector."),
    (r"^model\.language_model\.", "text."),
    (r"^lm_head\.", "text.lm_head."),
    (r"^vision_tower\.", "vision.tower."),
    (r"^multi_modal_projector\.", "vision.projector."),
    (r"^language_model\.model\.", "text."),
    (r"^language_model\.lm_head\.", "text.lm_head."),
)
IMAGE_CONTEXT, IMAGE_START, IMAGE_END = "<IMG_CONTEXT>", "<img>", "</img>"


def pixel_shuffle(features: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, side, side, c] -> [n, side*scale, side*scale, c/scale**2], as transformers'
    ``InternVLModel.pixel_shuffle`` (which names the axes width, height)."""
    n, width, height, channels = features.shape
    features = features.reshape(n, width, int(height * scale), int(channels / scale))
    features = features.permute(0, 2, 1, 3)
    features = features.reshape(n, int(height * scale), int(width * scale), int(channels / scale**2))
    return features.permute(0, 2, 1, 3)


class InternVLVisionEncoder(nn.Module):
    """Tiles [n, 3, S, S] -> projected features [n * image_seq_length, text_hidden]."""

    def __init__(self, tower: nn.Module, projector: nn.Module, layer: int, drop_cls: bool, scale: float) -> None:
        super().__init__()
        self.tower = tower
        self.projector = projector
        self.layer = layer
        self.drop_cls = drop_cls
        self.scale = scale

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        pixel_values = pixel_values.to(self.projector.linear_1.weight.dtype)
        states = self.tower(pixel_values, output_hidden_states=True).hidden_states[self.layer]
        if self.drop_cls:
            states = states[:, 1:]
        side = int(states.shape[1] ** 0.5)
        shuffled = pixel_shuffle(states.reshape(states.shape[0], side, side, -1), self.scale)
        return self.projector(shuffled.flatten(1, 2)).flatten(0, 1)


class InternVLAdapter(FamilyAdapter):
    architectures = ("InternVLForConditionalGeneration",)
    weight_renames = _RENAMES

    def decoder_config(self) -> DecoderConfig:
        # Qwen2 text models have q/k/v biases; Qwen3's have per-head q/k norms instead.
        text_type = self.text_config.model_type
        if text_type not in ("qwen2", "qwen3"):
            raise ModelLoadError(f"InternVL with a {text_type!r} text model is not supported (qwen2, qwen3)")
        cfg = DecoderConfig.from_hf(self.text_config, qkv_bias=text_type == "qwen2")
        tied = getattr(self.config, "tie_word_embeddings", None)
        return dataclasses.replace(cfg, qk_norm=text_type == "qwen3",
                                   tie_word_embeddings=cfg.tie_word_embeddings if tied is None else bool(tied))

    @property
    def image_marker(self) -> str:
        return IMAGE_CONTEXT

    @property
    def image_seq_length(self) -> int:
        return int(self.checkpoint.processor_config.get("image_seq_length", self.config.image_seq_length))

    @property
    def patches_per_token(self) -> int:
        return round(1 / self.config.downsample_ratio**2)

    def process_image(self, image) -> ImageInputs:
        out = self.image_processor(images=[image], crop_to_patches=True, return_tensors="pt")
        tiles = int(out["num_patches"][0])
        num_tokens = tiles * self.image_seq_length
        return ImageInputs(tensors={"pixel_values": out["pixel_values"]}, num_tokens=num_tokens,
                           placeholder=IMAGE_START + IMAGE_CONTEXT * num_tokens + IMAGE_END)

    def build_vision(self, tensors, dtype):
        from transformers import InternVLVisionModel
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        vision = self.config.vision_config
        layer = feature_layers(self.config.vision_feature_layer, vision.num_hidden_layers)
        if len(layer) != 1:
            raise ModelLoadError(f"vision_feature_layer={self.config.vision_feature_layer!r}: one layer is supported")
        with torch.device("meta"):
            tower = InternVLVisionModel._from_config(vision)
            projector = InternVLMultiModalProjector(self.config)
        drop_cls = self.config.vision_feature_select_strategy == "default"
        module = InternVLVisionEncoder(tower, projector, layer[0], drop_cls, self.config.downsample_ratio)
        return load_module_state(module, tensors, dtype).eval()

    def vision_graph(self, vision):
        return VisionGraph(vision, ("pixel_values",), "tiles")  # tiles are independent pictures

    def image_limits(self):
        return {"max_side": None, "max_pixels": None, "min_side": None}
