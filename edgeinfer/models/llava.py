"""LLaVA-1.5 and LLaVA-NeXT (1.6): a CLIP or SigLIP tower, a two-layer projector, a Llama/Mistral text model.

LLaVA-1.5 brings every image to the tower's square and spends one token per patch.
LLaVA-NeXT ("any-res") also resizes the image to the best of ``image_grid_pinpoints``,
cuts it into tower-sized crops, stitches their features back into one grid, cuts away
the rows or columns that only saw the processor's padding and ends each row with the
learned ``image_newline``; the whole-image (base) view comes first.

Features come from the tower's hidden states named by ``vision_feature_layer`` (one
index, or several concatenated), without the CLS token when the strategy is
"default", exactly as transformers' ``get_image_features`` selects them. Layers after
the deepest selected one never run: they are not built.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from edgeinfer.errors import ModelLoadError
from edgeinfer.models.base import FamilyAdapter, ImageInputs, load_module_state
from edgeinfer.models.decoder import DecoderConfig
from edgeinfer.models.export import VISION_OUTPUT, VisionGraph

# transformers 5 names first, then the names checkpoints are saved (and published) with. The
# tower's own ``vision_model.`` level is gone from transformers 5's CLIP and SigLIP modules.
_LLAVA_RENAMES = (
    (r"^model\.vision_tower\.(vision_model\.)?", "vision.tower."),
    (r"^model\.multi_modal_projector\.", "vision.projector."),
    (r"^model\.language_model\.", "text."),
    (r"^lm_head\.", "text.lm_head."),
    (r"^vision_tower\.(vision_model\.)?", "vision.tower."),
    (r"^multi_modal_projector\.", "vision.projector."),
    (r"^language_model\.model\.", "text."),
    (r"^language_model\.lm_head\.", "text.lm_head."),
)
_NEWLINE_RENAMES = (
    (r"^model\.image_newline$", "vision.image_newline"),
    (r"^image_newline$", "vision.image_newline"),
)

# Tokens a tower puts before its patch tokens (CLIP's CLS); towers not named here are refused.
TOWER_PREFIX_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}


def feature_layers(vision_feature_layer: int | list[int], num_layers: int) -> tuple[int, ...]:
    """Indices into a tower's ``hidden_states`` (``num_layers + 1`` entries), made non-negative."""
    wanted = [vision_feature_layer] if isinstance(vision_feature_layer, int) else list(vision_feature_layer)
    states = num_layers + 1
    if not wanted or any(not -states <= i < states for i in wanted):
        raise ModelLoadError(f"vision_feature_layer={vision_feature_layer!r} is outside the tower's "
                             f"{states} hidden states")
    return tuple(i % states for i in wanted)


def finish_vision(module: "LlavaVisionEncoder") -> "LlavaVisionEncoder":
    """Fill what loading cannot: CLIP and SigLIP keep their position ids in a non-persistent buffer."""
    embeddings = module.tower.embeddings
    embeddings.position_ids = torch.arange(embeddings.num_positions).expand((1, -1))
    left = [name for name, buf in module.named_buffers() if buf.is_meta]
    if left:
        raise ValueError(f"vision buffers {left[:4]} have no values after loading")
    return module.eval()


class LlavaVisionEncoder(nn.Module):
    """pixel crops [n, 3, S, S] -> projected features [n * tokens, text_hidden]."""

    def __init__(self, tower: nn.Module, projector: nn.Module, layers: tuple[int, ...], drop_cls: bool) -> None:
        super().__init__()
        self.tower = tower
        self.projector = projector
        self.layers = layers
        self.drop_cls = drop_cls

    def crop_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, tokens per crop, text_hidden]."""
        pixel_values = pixel_values.to(self.projector.linear_1.weight.dtype)
        states = self.tower(pixel_values, output_hidden_states=True).hidden_states
        selected = torch.cat([states[i] for i in self.layers], dim=-1)
        if self.drop_cls:
            selected = selected[:, 1:]
        return self.projector(selected)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.crop_features(pixel_values).flatten(0, 1)


class AnyResVisionEncoder(LlavaVisionEncoder):
    """LLaVA-NeXT: base view + crops of one image -> [tokens, text_hidden], packed as transformers packs them."""

    def __init__(self, tower: nn.Module, projector: nn.Module, layers: tuple[int, ...], drop_cls: bool,
                 image_newline: nn.Parameter, grid_pinpoints: list[list[int]], crop_size: int, patch_size: int) -> None:
        super().__init__(tower, projector, layers, drop_cls)
        self.image_newline = image_newline
        self.grid_pinpoints = grid_pinpoints
        self.crop_size = crop_size
        self.side = crop_size // patch_size  # patch tokens along one side of a crop

    def forward(self, pixel_values: torch.Tensor, image_size: torch.Tensor) -> torch.Tensor:
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        features = self.crop_features(pixel_values)
        base, crops = features[0], features[1:]
        rows, cols = get_anyres_image_grid_shape(image_size, self.grid_pinpoints, self.crop_size)
        s = self.side
        grid = crops.view(rows, cols, s, s, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        grid = unpad_image(grid, image_size)  # [hidden, H, W] without the padded margins
        newline = self.image_newline[:, None, None].expand(*grid.shape[:-1], 1).to(grid.dtype)
        grid = torch.cat((grid, newline), dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat((base, grid))


class CropFeatures(nn.Module):
    """LLaVA-NeXT's tower + projector over crops: [n, 3, S, S] -> [n, tokens, text_hidden]."""

    def __init__(self, vision: AnyResVisionEncoder) -> None:
        super().__init__()
        self.vision = vision

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision.crop_features(pixel_values)


class AnyResVisionGraph(VisionGraph):
    """LLaVA-NeXT: crop features in the graph; the any-res packing, whose shapes follow the
    image size, on the host through the encoder's own ``forward``."""

    def __init__(self, vision: AnyResVisionEncoder) -> None:
        super().__init__(vision, ("pixel_values",), "crops")

    def module(self) -> nn.Module:
        return CropFeatures(self.vision)

    def dynamic_axes(self):
        return {"pixel_values": {0: "crops"}, VISION_OUTPUT: {0: "crops"}}

    def finish(self, output, tensors):
        packer = copy.copy(self.vision)  # shares the weights; only crop_features is replaced
        packer.crop_features = lambda pixel_values: output.to(pixel_values.dtype)
        with torch.no_grad():
            return packer(tensors["pixel_values"], tensors["image_size"])


class LlavaAdapter(FamilyAdapter):
    architectures = ("LlavaForConditionalGeneration",)
    weight_renames = _LLAVA_RENAMES

    def __init__(self, checkpoint) -> None:
        super().__init__(checkpoint)
        vision = self.config.vision_config
        if vision.model_type not in TOWER_PREFIX_TOKENS:
            raise ModelLoadError(f"vision tower {vision.model_type!r} is not supported by {type(self).__name__}; "
                                 f"supported: {sorted(TOWER_PREFIX_TOKENS)}")
        strategy = self.config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy={strategy!r}; expected 'default' or 'full'")
        self.drop_cls = strategy == "default"
        self.layers = feature_layers(self.config.vision_feature_layer, vision.num_hidden_layers)

    # --- text side -----------------------------------------------------------------
    def decoder_config(self) -> DecoderConfig:
        # Mistral text models may attend through a window; past it our full attention would differ.
        window = getattr(self.text_config, "sliding_window", None)
        if window is not None:
            raise ValueError(f"text model uses sliding-window attention (window {window}), which the decoder "
                             "does not implement")
        return super().decoder_config()

    # --- vision side ---------------------------------------------------------------
    @property
    def patch_size(self) -> int:
        return int(self.config.vision_config.patch_size)

    def crop_tokens(self, height: int, width: int) -> int:
        """Image tokens of one crop of ``height x width`` pixels (LlavaProcessor's count)."""
        prefix = TOWER_PREFIX_TOKENS[self.config.vision_config.model_type]
        return (height // self.patch_size) * (width // self.patch_size) + prefix - int(self.drop_cls)

    def build_tower(self) -> nn.Module:
        """The transformers tower on the meta device, cut after the deepest selected layer and
        without SigLIP's pooling head: only hidden states are read."""
        from transformers import AutoModel

        vision_config = copy.deepcopy(self.config.vision_config)
        vision_config.num_hidden_layers = max(self.layers)
        if getattr(vision_config, "vision_use_head", False):
            vision_config.vision_use_head = False
        with torch.device("meta"):
            return AutoModel.from_config(vision_config)

    def build_projector(self) -> nn.Module:
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        with torch.device("meta"):
            return LlavaMultiModalProjector(self.config)

    def build_vision(self, tensors, dtype):
        module = LlavaVisionEncoder(self.build_tower(), self.build_projector(), self.layers, self.drop_cls)
        return finish_vision(load_module_state(module, tensors, dtype))

    def vision_graph(self, vision):
        """LLaVA-1.5: crops -> embeddings, dynamic crop count."""
        return VisionGraph(vision, ("pixel_values",), "crops")

    def process_image(self, image) -> ImageInputs:
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]  # [1, 3, H, W]
        n = self.crop_tokens(*pixels.shape[-2:])
        return ImageInputs(tensors={"pixel_values": pixels}, num_tokens=n, placeholder=self.image_marker * n)

    def image_limits(self):
        height, width = self._processed_size()
        return {"max_side": None, "max_pixels": None, "min_side": None,
                "resized_height": height, "resized_width": width}

    def _processed_size(self) -> tuple[int, int]:
        """(height, width) of what the processor hands the tower: its crop, else its resize target."""
        ip = self.image_processor
        crop, size = getattr(ip, "crop_size", None), getattr(ip, "size", None)
        if getattr(ip, "do_center_crop", False) and crop:
            return int(crop["height"]), int(crop["width"])
        if size and size.get("height"):
            return int(size["height"]), int(size["width"])
        edge = size.get("shortest_edge") if size else None
        edge = int(edge or self.config.vision_config.image_size)
        return edge, edge


class LlavaNextAdapter(LlavaAdapter):
    architectures = ("LlavaNextForConditionalGeneration",)
    weight_renames = _LLAVA_RENAMES + _NEWLINE_RENAMES

    @property
    def grid_pinpoints(self) -> list[list[int]]:
        return [list(p) for p in self.config.image_grid_pinpoints]

    @property
    def crop_size(self) -> int:
        return int(self.config.vision_config.image_size)

    def image_token_count(self, height: int, width: int) -> int:
        """Image tokens of an ``height x width`` image: the base view, then the unpadded grid with one
        newline per row. The shapes come from transformers' own any-res helpers, applied to an empty
        tensor, so the count is the row count of the packed features."""
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        side = self.crop_size // self.patch_size
        rows, cols = get_anyres_image_grid_shape((height, width), self.grid_pinpoints, self.crop_size)
        grid_h, grid_w = unpad_image(torch.empty(0, rows * side, cols * side), (height, width)).shape[1:]
        return self.crop_tokens(self.crop_size, self.crop_size) + grid_h * (grid_w + 1)

    def build_projector(self) -> nn.Module:
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

        with torch.device("meta"):
            return LlavaNextMultiModalProjector(self.config)

    def build_vision(self, tensors, dtype):
        newline = nn.Parameter(torch.empty(self.text_config.hidden_size, device="meta"))
        module = AnyResVisionEncoder(self.build_tower(), self.build_projector(), self.layers, self.drop_cls,
                                     newline, self.grid_pinpoints, self.crop_size, self.patch_size)
        return finish_vision(load_module_state(module, tensors, dtype))

    def vision_graph(self, vision):
        return AnyResVisionGraph(vision)

    def process_image(self, image) -> ImageInputs:
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels, size = out["pixel_values"][0], out["image_sizes"][0]  # [1 + crops, 3, S, S], (H, W)
        n = self.image_token_count(int(size[0]), int(size[1]))
        return ImageInputs(tensors={"pixel_values": pixels, "image_size": size}, num_tokens=n,
                           placeholder=self.image_marker * n)

    def image_limits(self):
        limits = super().image_limits()
        largest = max(self.grid_pinpoints, key=lambda p: p[0] * p[1])
        return limits | {"max_grid_height": int(largest[0]), "max_grid_width": int(largest[1])}
