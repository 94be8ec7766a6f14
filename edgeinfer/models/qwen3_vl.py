"""Qwen3-VL: a Qwen2-VL-style native-resolution tower with deepstack, a Qwen3 text model.

What changes from Qwen2-VL (``models/qwen2_vl.py``), following transformers' own modeling:

- the text model is Qwen3's: RMSNorm over each head of q and k before RoPE, no q/k/v bias;
- M-RoPE is interleaved: the temporal, row and column axes take alternate frequencies
  (``decoder.mrope_frequencies``) instead of three sections;
- *deepstack*: the tower's merged features after a few of its blocks
  (``deepstack_visual_indexes``) are added to the hidden states after the decoder's first
  layers, at the image positions. The vision engine returns them beside the embeddings,
  in one row per image token of width ``(1 + D) * hidden``; the decoder splits the row
  (``decoder.split_visual_additions``). So the vision cache and the prefix cache hold them
  with the embeddings, and text tokens carry zeros there (adding zero changes nothing);
- the tower adds learned position embeddings, resampled bilinearly to the image's grid,
  and runs with patches of 16 pixels, so one image token covers 32 x 32 pixels.

Image tokens lay out as in Qwen2-VL (``<|vision_start|><|image_pad|>*n<|vision_end|>``),
and their positions too: for a single-frame image the text after it resumes at
``start + max(h, w) / merge``, which is the largest image position plus one.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from edgeinfer.models.base import load_module_state
from edgeinfer.models.decoder import DecoderConfig
from edgeinfer.models.export import VISION_OUTPUT, VisionGraph
from edgeinfer.models.qwen2_vl import Qwen2VLAdapter, segment_attention

# What transformers' Qwen3-VL text rotary embedding falls back to when the config names no sections.
DEFAULT_MROPE_SECTION = (24, 20, 20)

_RENAMES = (
    (r"^model\.visual\.", "vision.visual."),
    (r"^model\.language_model\.", "text."),
    (r"^lm_head\.", "text.lm_head."),
)


class Qwen3VisionEncoder(nn.Module):
    """Flattened patches + ``image_grid_thw`` -> ``[num_tokens, (1 + D) * text_hidden]``: each
    image token's embedding, then its deepstack features for decoder layers ``0..D-1``."""

    graph_safe = False  # the tower reads the grid's values on the device (position-embedding resampling)
    host_inputs = ()

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        out = self.visual(pixel_values, grid_thw=image_grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


class Qwen3Tower(nn.Module):
    """The Qwen3-VL tower with what it derives from the grid given as inputs instead of ``grid_thw``:
    the rotary position ids, the segment boundaries and the position-embedding resampling."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values, position_ids, cu_seqlens, interp_indices, interp_weights):
        unused_grid = torch.zeros(1, 3, dtype=torch.int64)  # with every derived tensor given, never read
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        out = self.visual(pixel_values, grid_thw=unused_grid, position_ids=position_ids, cu_seqlens=cu_seqlens,
                          interp_indices=interp_indices, interp_weights=interp_weights)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


class Qwen3VisionGraph(VisionGraph):
    """Flattened patches + rotary position ids + segment boundaries + the bilinear taps of the
    learned position grid -> embeddings with their deepstack features, dynamic patch count.
    The host derives the grid's tensors with transformers' own functions; the graph attends
    within segments through a block-diagonal mask (``qwen2_vl.segment_attention``)."""

    independent_rows = False  # the patches of an image attend to each other
    NAMES = ("pixel_values", "position_ids", "cu_seqlens", "interp_indices", "interp_weights")

    def __init__(self, vision: Qwen3VisionEncoder) -> None:
        super().__init__(vision, self.NAMES, "patches")

    def module(self) -> nn.Module:
        return Qwen3Tower(self.vision.visual)

    def dynamic_axes(self):
        return {"pixel_values": {0: "patches"}, "position_ids": {0: "patches"}, "cu_seqlens": {0: "segments"},
                "interp_indices": {0: "patches"}, "interp_weights": {0: "patches"}, VISION_OUTPUT: {0: "image_tokens"}}

    def feeds(self, tensors):
        from transformers.vision_utils import (
            get_vision_cu_seqlens,
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )

        visual, grid = self.vision.visual, tensors["image_grid_thw"]
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.spatial_merge_size)
        return {"pixel_values": tensors["pixel_values"].float(),
                "position_ids": get_vision_position_ids(grid, visual.spatial_merge_size),
                "cu_seqlens": get_vision_cu_seqlens(grid).to(torch.int64),
                "interp_indices": indices.to(torch.int64), "interp_weights": weights.float()}

    def exporting(self):
        return segment_attention(self.vision.visual.blocks)


class Qwen3VLAdapter(Qwen2VLAdapter):
    architectures = ("Qwen3VLForConditionalGeneration",)
    weight_renames = _RENAMES
    qkv_bias = False

    @property
    def vision_hidden(self) -> int:
        return int(self.config.vision_config.hidden_size)

    def decoder_config(self) -> DecoderConfig:
        # transformers interleaves the axes whatever the config's mrope_interleaved says.
        cfg = super(Qwen2VLAdapter, self).decoder_config()
        return dataclasses.replace(cfg, mrope_section=cfg.mrope_section or DEFAULT_MROPE_SECTION,
                                   mrope_interleaved=True, qk_norm=True,
                                   deepstack_layers=len(self.config.vision_config.deepstack_visual_indexes))

    def build_vision(self, tensors, dtype):
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m

        with torch.device("meta"):
            tower = m.Qwen3VLVisionModel._from_config(self.config.vision_config)
        module = load_module_state(Qwen3VisionEncoder(tower), tensors, dtype)
        # The rotary frequencies are a non-persistent buffer, so nothing loaded them off meta.
        tower.rotary_pos_emb = m.Qwen3VLVisionRotaryEmbedding(tower.config)
        return module.eval()

    def vision_graph(self, vision):
        return Qwen3VisionGraph(vision)
