"""Qwen2-VL and Qwen2.5-VL: native-resolution vision tower, Qwen2 text model with M-RoPE.

An image is resized so both sides are multiples of ``patch_size * merge_size`` and its
pixel count lies within the processor's ``[min_pixels, max_pixels]``; it becomes a
``(t, h, w)`` grid of patches, and every ``merge_size x merge_size`` block of patches one
token. The published chat template emits ``<|vision_start|><|image_pad|><|vision_end|>``
per image; the single ``<|image_pad|>`` is expanded to one per token, as transformers'
processor does.

Positions have three axes (temporal, height, width). Text tokens advance all three
together; an image's tokens take their grid coordinates offset by the position where the
image starts, and the text after it resumes at the largest position so far plus one. So a
prompt's last position is smaller than its length, and generated tokens continue from
``next_position`` (transformers calls the difference the rope delta).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.models.base import FamilyAdapter, ImageInputs, PromptLayout, load_module_state
from edgeinfer.models.decoder import DecoderConfig, rotate_half
from edgeinfer.models.export import VISION_OUTPUT, VisionGraph

# transformers 5 saves the legacy hub names; its in-memory names come first because the
# legacy text prefix ``model.`` would also match them.
_RENAMES = (
    (r"^model\.visual\.", "vision.visual."),
    (r"^model\.language_model\.", "text."),
    (r"^visual\.", "vision.visual."),
    (r"^model\.", "text."),
    (r"^lm_head\.", "text.lm_head."),
)

# What transformers' text rotary embedding falls back to when the config names no sections.
DEFAULT_MROPE_SECTION = (16, 24, 24)
IMAGE_PAD = "<|image_pad|>"


class QwenVisionEncoder(nn.Module):
    """Flattened patches + ``image_grid_thw`` -> merged tokens ``[num_tokens, text_hidden]``.

    Qwen2-VL's tower runs block by block here, from its own layers: the rotary angles and
    the images' boundaries follow from the grid, which stays on the host, so nothing in the
    forward waits on the device and a CUDA graph can hold all of it (``graph_safe``).
    Qwen2.5-VL's windowed tower runs as transformers wrote it.
    """

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual
        self.graph_safe = not hasattr(visual, "fullatt_block_indexes")
        # Inputs the caller keeps on the host (their values steer the code, not the arithmetic).
        self.host_inputs = ("image_grid_thw",) if self.graph_safe else ()

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        visual = self.visual
        pixel_values = pixel_values.to(visual.patch_embed.proj.weight.dtype)
        if not self.graph_safe:
            return visual(pixel_values, grid_thw=image_grid_thw).pooler_output
        grids = [tuple(int(v) for v in row) for row in image_grid_thw.tolist()]
        x = visual.patch_embed(pixel_values)
        cos, sin = self._rotary(grids, x.device)
        attend = _each_segment([h * w for t, h, w in grids for _ in range(t)])  # a frame attends within itself
        for block in visual.blocks:
            x = x + vision_attention(block.attn, block.norm1(x), cos, sin, attend)
            x = x + block.mlp(block.norm2(x))
        return visual.merger(x)

    def _rotary(self, grids: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [patches, head_dim] of the tower's 2-D rotary embedding: a patch's row angles
        then its column angles, twice, patches ordered merge block by merge block."""
        m = int(self.visual.spatial_merge_size)
        inv_freq = self.visual.rotary_pos_emb.inv_freq.to(device, torch.float32)
        rows, cols = [], []
        for t, h, w in grids:
            hh = torch.arange(h, device=device)[:, None].expand(h, w)
            ww = torch.arange(w, device=device)[None, :].expand(h, w)
            for pos, out in ((hh, rows), (ww, cols)):
                out.append(pos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
        angles = torch.cat((torch.cat(rows)[:, None] * inv_freq, torch.cat(cols)[:, None] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def vision_attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
    """Qwen2-VL vision attention with ``attn``'s weights: q|k|v, the rotary embedding in float32
    as transformers applies it, the output projection. ``attend(q, k, v)`` (each
    ``[1, heads, patches, head_dim]``) is the softmax part, and decides where images part."""
    n = x.shape[0]
    q, k, v = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = ((t.float() * cos[:, None] + rotate_half(t.float()) * sin[:, None]).to(t.dtype) for t in (q, k))
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    return attn.proj(attend(q, k, v)[0].transpose(0, 1).reshape(n, -1))


def _each_segment(segments: list[int]):
    """``attend`` for ``vision_attention``: each run of ``segments`` patches attends within itself."""
    def attend(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(*parts)
                          for parts in zip(q.split(segments, 2), k.split(segments, 2), v.split(segments, 2))], dim=2)
    return attend


def _segment_attention(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    """Qwen vision attention over packed segments through a block-diagonal mask.

    transformers splits the sequence at ``cu_seqlens.tolist()``, which a trace would freeze;
    the mask keeps the segment boundaries an input of the graph.
    """
    n = hidden_states.shape[0]
    segment = (torch.arange(n, device=hidden_states.device)[:, None] >= cu_seqlens[None, 1:]).sum(-1)
    mask = (segment[:, None] == segment[None, :])[None, None]
    return vision_attention(self, hidden_states, *position_embeddings,
                            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling))


@contextlib.contextmanager
def segment_attention(blocks):
    """While exporting: the tower's attention blocks attend within segments through a mask
    (:func:`_segment_attention`) instead of transformers' per-segment loop."""
    attentions = [block.attn for block in blocks]
    for attn in attentions:
        attn.forward = types.MethodType(_segment_attention, attn)
    try:
        yield
    finally:
        for attn in attentions:
            del attn.forward


class QwenTower(nn.Module):
    """The Qwen tower with its grid-derived index tensors as inputs instead of ``grid_thw``."""

    def __init__(self, visual: nn.Module, windowed: bool) -> None:
        super().__init__()
        self.visual = visual
        self.windowed = windowed

    def forward(self, pixel_values, position_ids, cu_seqlens, window_index=None, cu_window_seqlens=None):
        given = {"position_ids": position_ids, "cu_seqlens": cu_seqlens}
        if self.windowed:
            given |= {"window_index": window_index, "cu_window_seqlens": cu_window_seqlens}
        # With every index tensor given, the tower never reads grid_thw.
        unused_grid = torch.zeros(1, 3, dtype=torch.int64)
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        return self.visual(pixel_values, grid_thw=unused_grid, **given).pooler_output


class QwenVisionGraph(VisionGraph):
    """Qwen2-VL / Qwen2.5-VL: flattened patches + rotary position ids + segment (and window)
    boundaries -> merged embeddings, dynamic patch count. The host derives the position
    ids, ``cu_seqlens`` and window order from ``image_grid_thw`` with transformers' own
    functions, and the graph attends within segments through a block-diagonal mask."""

    independent_rows = False  # the patches of an image attend to each other

    def __init__(self, vision: QwenVisionEncoder) -> None:
        visual = vision.visual
        self.windowed = hasattr(visual, "fullatt_block_indexes")
        names = ("pixel_values", "position_ids", "cu_seqlens")
        super().__init__(vision, names + (("window_index", "cu_window_seqlens") if self.windowed else ()), "patches")

    def module(self) -> nn.Module:
        return QwenTower(self.vision.visual, self.windowed)

    def dynamic_axes(self):
        axes = {"pixel_values": {0: "patches"}, "position_ids": {0: "patches"}, "cu_seqlens": {0: "segments"},
                VISION_OUTPUT: {0: "image_tokens"}}
        if self.windowed:
            axes |= {"window_index": {0: "image_tokens"}, "cu_window_seqlens": {0: "windows"}}
        return axes

    def feeds(self, tensors):
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

        visual, grid = self.vision.visual, tensors["image_grid_thw"]
        feeds = {"pixel_values": tensors["pixel_values"].float(),
                 "position_ids": get_vision_position_ids(grid, visual.spatial_merge_size),
                 "cu_seqlens": get_vision_cu_seqlens(grid).to(torch.int64)}
        if self.windowed:
            order, windows = get_vision_window_index(grid, visual.spatial_merge_size, visual.window_size,
                                                     visual.patch_size)
            feeds |= {"window_index": order, "cu_window_seqlens": windows.to(torch.int64)}
        return feeds

    def exporting(self):
        return segment_attention(self.vision.visual.blocks)


def mrope_positions(token_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                    merge_size: int) -> torch.Tensor:
    """[3, T] positions as transformers' ``get_rope_index`` computes them for images.

    Each image's tokens are the ``t * (h/m) * (w/m)`` image tokens starting at its first one,
    in the order the images were given; whatever follows starts at the largest position + 1.
    """
    chunks, start, i, n = [], 0, 0, len(token_ids)
    pending = list(grids)
    while i < n:
        if token_ids[i] == image_token_id:
            if not pending:
                raise ValueError(f"image tokens at {i} have no image left to fill them")
            t, h, w = pending.pop(0)
            chunk = image_grid_positions(t, h // merge_size, w // merge_size) + start
            if token_ids[i:i + chunk.shape[1]] != [image_token_id] * chunk.shape[1]:
                raise ValueError(f"the image at token {i} needs {chunk.shape[1]} consecutive image tokens")
        else:
            end = next((k for k in range(i, n) if token_ids[k] == image_token_id), n)
            chunk = torch.arange(start, start + end - i).expand(3, -1)
        chunks.append(chunk)
        start = int(chunk.max()) + 1
        i += chunk.shape[1]
    if pending:
        raise ValueError(f"{len(pending)} images have no image tokens in the prompt")
    return torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)


def image_grid_positions(t: int, h: int, w: int) -> torch.Tensor:
    """[3, t*h*w] (temporal, row, column) coordinates of a merged grid, row-major."""
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack((tt, hh, ww)).reshape(3, -1)


class Qwen2VLAdapter(FamilyAdapter):
    architectures = ("Qwen2VLForConditionalGeneration",)
    weight_renames = _RENAMES
    qkv_bias = True
    mrope = True

    def _vision_classes(self):
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m

        return m.Qwen2VisionTransformerPretrainedModel, m.Qwen2VLVisionRotaryEmbedding

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    @property
    def patches_per_token(self) -> int:
        return self.merge_size**2

    @property
    def vision_hidden(self) -> int:
        # Qwen2-VL names the tower's width embed_dim (hidden_size is the decoder's).
        vision = self.config.vision_config
        return int(getattr(vision, "embed_dim", None) or vision.hidden_size)

    @property
    def image_marker(self) -> str:
        return IMAGE_PAD

    def decoder_config(self) -> DecoderConfig:
        # A config without mrope_section gets transformers' default sections.
        cfg = super().decoder_config()
        return dataclasses.replace(cfg, mrope_section=cfg.mrope_section or DEFAULT_MROPE_SECTION)

    # --- vision side ---------------------------------------------------------------
    def build_vision(self, tensors, dtype):
        tower_cls, rotary_cls = self._vision_classes()
        with torch.device("meta"):
            tower = tower_cls._from_config(self.config.vision_config)
        module = load_module_state(QwenVisionEncoder(tower), tensors, dtype)
        # The rotary frequencies are a non-persistent buffer, so nothing loaded them off meta.
        tower.rotary_pos_emb = rotary_cls(tower.config)
        return module.eval()

    def vision_graph(self, vision):
        return QwenVisionGraph(vision)

    def process_image(self, image) -> ImageInputs:
        out = self.image_processor(images=[image], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        num_tokens = t * h * w // self.merge_size**2
        return ImageInputs(
            tensors={"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]},
            num_tokens=num_tokens,
            placeholder=IMAGE_PAD * num_tokens,
            grid=(t, h, w),
        )

    def layout(self, token_ids: list[int], images: list[ImageInputs]) -> PromptLayout:
        positions = mrope_positions(token_ids, self.image_token_id, [im.grid for im in images], self.merge_size)
        next_position = int(positions.max()) + 1 if positions.numel() else 0
        return PromptLayout(token_ids, positions, next_position, self.image_token_id)

    def image_limits(self):
        size = self.image_processor.size
        factor = int(self.image_processor.patch_size) * int(self.image_processor.merge_size)
        # The PIL processor keeps min/max pixels under size's shortest_edge/longest_edge.
        max_pixels = getattr(size, "longest_edge", None) or getattr(size, "max_pixels", None)
        min_pixels = getattr(size, "shortest_edge", None) or getattr(size, "min_pixels", None)
        return {"max_side": None, "max_pixels": None if max_pixels is None else int(max_pixels),
                "min_side": factor, "min_pixels": None if min_pixels is None else int(min_pixels)}


class Qwen25VLAdapter(Qwen2VLAdapter):
    """Qwen2.5-VL: windowed attention and SwiGLU in the tower; images lay out as in Qwen2-VL
    (its temporal spacing by ``second_per_grid_ts`` applies to videos only)."""

    architectures = ("Qwen2_5_VLForConditionalGeneration",)

    def _vision_classes(self):
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        return m.Qwen2_5_VisionTransformerPretrainedModel, m.Qwen2_5_VLVisionRotaryEmbedding
