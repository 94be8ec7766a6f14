"""SmolVLM and Idefics3: SigLIP-style tower, pixel-shuffle connector, Llama text model.

An image is split into tiles of the processor's ``max_image_size`` plus one global view;
each tile becomes ``image_seq_len`` tokens. The prompt text around them follows the
published layout: ``<fake_token_around_image><row_r_col_c><image>*n ... \\n\\n
<fake_token_around_image><global-img><image>*n<fake_token_around_image>``.
"""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.models.base import FamilyAdapter, ImageInputs, load_module_state
from edgeinfer.models.export import VisionGraph

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
        p = self.patch_size
        pixel_values = pixel_values.to(self.connector.modality_projection.proj.weight.dtype)
        patches = pixel_attention_mask.unfold(1, p, p).unfold(2, p, p)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask).last_hidden_state
        features = self.connector(hidden)
        return features.reshape(-1, features.shape[-1])


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
        """Tiles + pixel mask -> embeddings, dynamic tile count."""
        return VisionGraph(vision, ("pixel_values", "pixel_attention_mask"), "tiles")

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
