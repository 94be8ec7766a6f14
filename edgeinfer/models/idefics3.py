"""SmolVLM and Idefics3: SigLIP-style tower, pixel-shuffle connector, Llama text model.

An image is split into tiles of the processor's ``max_image_size`` plus one global view;
each tile becomes ``image_seq_len`` tokens. The prompt text around them follows the
published layout: ``<fake_token_around_image><row_r_col_c><image>*n ... \\n\\n
<fake_token_around_image><global-img><image>*n<fake_token_around_image>``.

The exported graph takes each patch's position id as an input (:class:`TiledVisionGraph`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from edgeinfer.models.base import FamilyAdapter, ImageInputs, load_module_state
from edgeinfer.models.export import AttentionShape, VisionGraph

_RENAMES = (
    (r"^model\.vision_model\.", "vision.vision_model."),
    (r"^model\.connector\.", "vision.connector."),
    (r"^model\.text_model\.", "text."),
    (r"^lm_head\.", "text.lm_head."),
)


class TiledVisionEncoder(nn.Module):
    """pixel tiles -> connector output, flattened to [tiles * image_seq_len, text_hidden]."""

    def __init__(self, vision_model: nn.Module, connector: nn.Module, patch_size: int) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.connector = connector
        self.patch_size = patch_size

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        pixel_values = pixel_values.to(self.connector.modality_projection.proj.weight.dtype)
        patch_mask = self.patch_mask(pixel_attention_mask)
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask).last_hidden_state
        return self.tokens(hidden)

    def patch_mask(self, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, H, W] pixel mask -> [tiles, H/p, W/p]: a patch is real when any of its pixels is."""
        p = self.patch_size
        return pixel_attention_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tower's last hidden state -> connector output [tiles * image_seq_len, text_hidden]."""
        features = self.connector(hidden)
        return features.reshape(-1, features.shape[-1])


def patch_position_ids(patch_mask: torch.Tensor, patches_per_side: int) -> torch.Tensor:
    """[tiles, h, w] patch mask -> [tiles, h*w] int64 ids into the tower's position table.

    The arithmetic of transformers' ``Idefics3VisionEmbeddings``: a tile of ``rows x cols``
    real patches spreads them over the ``patches_per_side`` square table by bucketing each
    patch's fractional coordinate; padding patches take id 0.
    """
    tiles, h, w = patch_mask.shape
    device = patch_mask.device
    boundaries = torch.arange(1 / patches_per_side, 1.0, 1 / patches_per_side, device=device)
    rows, cols = patch_mask[:, :, 0].sum(dim=1), patch_mask[:, 0, :].sum(dim=1)
    buckets = []
    for count, length in ((rows, h), (cols, w)):
        fractions = torch.arange(length, dtype=torch.float32, device=device)[None, :] * (1.0 / count)[:, None]
        buckets.append(torch.bucketize(fractions.clamp(max=1.0 - 1e-6), boundaries, right=True))
    ids = (buckets[0][:, :, None] * patches_per_side + buckets[1][:, None, :]).reshape(tiles, -1)
    return torch.where(patch_mask.reshape(tiles, -1), ids, 0).to(torch.int64)


class TileTower(nn.Module):
    """The tower and connector of :class:`TiledVisionEncoder` with each patch's mask and
    position id as inputs: [tiles, 3, S, S], [tiles, patches], [tiles, patches] -> tokens.

    transformers computes the position ids inside the embeddings, and what its trace gives
    differs between versions (a scatter into a tensor torch types float on some); given as
    an input, the graph holds one Gather of the position table instead. The rest is the
    tower's own forward: patch embedding, bidirectional mask, encoder, final norm.
    """

    def __init__(self, encoder: TiledVisionEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor,
                patch_position_ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        tower = self.encoder.vision_model
        embeddings = tower.embeddings
        pixel_values = pixel_values.to(embeddings.patch_embedding.weight.dtype)
        x = embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        x = x + embeddings.position_embedding(patch_position_ids)
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=x, attention_mask=patch_attention_mask)
        hidden = tower.post_layernorm(tower.encoder(inputs_embeds=x, attention_mask=mask).last_hidden_state)
        return self.encoder.tokens(hidden)


class TiledVisionGraph(VisionGraph):
    """SmolVLM / Idefics3: tiles, their patch mask and patch position ids -> embeddings,
    dynamic tile count; the mask and ids come from the pixel mask on the host."""

    def __init__(self, vision: TiledVisionEncoder) -> None:
        super().__init__(vision, ("pixel_values", "patch_attention_mask", "patch_position_ids"), "tiles")

    def module(self) -> nn.Module:
        return TileTower(self.vision)

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """The tower traced with transformers' eager attention: an additive mask and a softmax.
        Traced through SDPA, a bool mask became a Where and an IsNaN over every head's
        [patches, patches] scores, a quarter of an int8 tile's time on a 2-core CPU."""
        config = self.vision.vision_model.config
        before = config._attn_implementation
        config._attn_implementation = "eager"
        try:
            yield
        finally:
            config._attn_implementation = before

    def fused_attention(self) -> AttentionShape:
        """SigLIP's attention (measured on SmolVLM-256M's tower: docs/onnxruntime.md)."""
        config = self.vision.vision_model.config
        return AttentionShape(config.num_attention_heads, config.hidden_size, key_padding_mask="patch_attention_mask")

    def feeds(self, tensors):
        patch_mask = self.vision.patch_mask(tensors["pixel_attention_mask"])
        side = self.vision.vision_model.embeddings.num_patches_per_side
        return {"pixel_values": tensors["pixel_values"],
                "patch_attention_mask": patch_mask.flatten(1),
                "patch_position_ids": patch_position_ids(patch_mask, side)}


class Idefics3Adapter(FamilyAdapter):
    architectures = ("Idefics3ForConditionalGeneration",)
    weight_renames = _RENAMES

    def _modules(self):
        from transformers.models.idefics3 import modeling_idefics3 as m

        return m.Idefics3VisionTransformer, m.Idefics3Connector

    @property
    def patches_per_token(self) -> int:
        return int(self.config.scale_factor) ** 2

    @property
    def image_seq_len(self) -> int:
        v = self.config.vision_config
        return int(((v.image_size // v.patch_size) ** 2) / (self.config.scale_factor**2))

    def build_vision(self, tensors, dtype):
        tower_cls, connector_cls = self._modules()
        with torch.device("meta"):
            tower = tower_cls._from_config(self.config.vision_config)
            connector = connector_cls(self.config)
        module = TiledVisionEncoder(tower, connector, self.config.vision_config.patch_size)
        return load_module_state(module, tensors, dtype).eval()

    def vision_graph(self, vision):
        return TiledVisionGraph(vision)

    def process_image(self, image) -> ImageInputs:
        out = self.image_processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        pixels = out["pixel_values"][0]  # [tiles, 3, H, W]
        mask = out.get("pixel_attention_mask")
        mask = mask[0] if mask is not None else torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool)
        tiles = pixels.shape[0]
        return ImageInputs(
            tensors={"pixel_values": pixels, "pixel_attention_mask": mask.bool()},
            num_tokens=tiles * self.image_seq_len,
            placeholder=self.placeholder(rows, cols),
        )

    def placeholder(self, rows: int, cols: int) -> str:
        fake, image, glob = "<fake_token_around_image>", "<image>", "<global-img>"
        tokens = image * self.image_seq_len
        if rows == 0 and cols == 0:
            return f"{fake}{glob}{tokens}{fake}"
        text = ""
        for r in range(rows):
            for c in range(cols):
                text += f"{fake}<row_{r + 1}_col_{c + 1}>{tokens}"
            text += "\n"
        return text + f"\n{fake}{glob}{tokens}{fake}"

    def image_limits(self):
        longest = (getattr(self.image_processor, "size", None) or {}).get("longest_edge")
        return {"max_side": None, "max_pixels": None, "min_side": None, "resized_longest_edge": longest}


class SmolVLMAdapter(Idefics3Adapter):
    architectures = ("SmolVLMForConditionalGeneration",)

    def _modules(self):
        from transformers.models.smolvlm import modeling_smolvlm as m

        return m.SmolVLMVisionTransformer, m.SmolVLMConnector
