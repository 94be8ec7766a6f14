"""The family adapter contract: what a VLM family tells the runtime.

An adapter knows its checkpoint's weight names (as data), its image processing and
placeholder expansion, its position ids, how to build its vision engine and that engine's
export graph. It knows nothing about KV tiers or scheduling.
"""

from __future__ import annotations

import dataclasses
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from edgeinfer.models.decoder import Decoder, DecoderConfig, load_decoder_weights, rope_inv_freq
from edgeinfer.models.export import VisionGraph


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What the loader read from a Hugging Face folder."""

    path: Path
    config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    image_processor: Any  # a transformers image processor (PIL backend)
    chat_template: str | None
    processor_config: dict = field(default_factory=dict)


@dataclass(slots=True)
class ImageInputs:
    """One image, processed: what its vision engine takes and what its placeholder becomes."""

    tensors: dict[str, torch.Tensor]
    num_tokens: int  # image-token count in the prompt; equals the rows of its embeddings
    placeholder: str  # the expanded prompt text that replaces the template's image marker
    grid: tuple[int, int, int] | None = None  # (t, h, w) patch grid for M-RoPE families


@dataclass(slots=True)
class PromptLayout:
    """Token ids of a prompt with its positions; image tokens are filled from embeddings."""

    token_ids: list[int]
    position_ids: torch.Tensor  # [T], or [3, T] for M-RoPE
    next_position: int  # position of the first generated token
    image_token_id: int
    # [T] image run of each token (-1 for text), for families whose images attend to
    # themselves in both directions (Gemma 3); None: causal everywhere.
    attend_groups: torch.Tensor | None = None


WeightRenames = tuple[tuple[str, str], ...]


class FamilyAdapter(ABC):
    """Base of every VLM family. Subclasses declare data; the loader does the rest."""

    architectures: ClassVar[tuple[str, ...]]
    # (regex, replacement) applied in order, first match wins; targets start with
    # "vision." (the vision engine module), "text." (decoder) or are dropped when "".
    weight_renames: ClassVar[WeightRenames]
    qkv_bias: ClassVar[bool] = False
    mrope: ClassVar[bool] = False
    # The tokens that open and close a reasoning variant's thinking span, where its tokenizer has them.
    thinking_markers: ClassVar[tuple[str, str]] = ("<think>", "</think>")

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.image_processor = checkpoint.image_processor

    # --- text side -----------------------------------------------------------------
    @property
    def text_config(self):
        return self.config.text_config

    def decoder_config(self) -> DecoderConfig:
        cfg = DecoderConfig.from_hf(self.text_config, qkv_bias=self.qkv_bias, mrope=self.mrope)
        # transformers 5 keeps tying on the outer config (older saves are forwarded there).
        tied = getattr(self.config, "tie_word_embeddings", None)
        return cfg if tied is None else dataclasses.replace(cfg, tie_word_embeddings=bool(tied))

    def build_decoder(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Decoder:
        inv_freq, scaling = rope_inv_freq(self.text_config)
        with torch.device("meta"):
            decoder = Decoder(self.decoder_config(), inv_freq.to("meta"), scaling)
        decoder = decoder.to_empty(device="cpu").to(dtype)
        decoder.inv_freq = inv_freq.float()
        load_decoder_weights(decoder, tensors)
        return decoder.eval()

    @property
    def image_token_id(self) -> int:
        return int(self.config.image_token_id)

    @property
    def image_marker(self) -> str:
        """The text the chat template emits for one image, before expansion."""
        return "<image>"

    def stop_token_ids(self) -> tuple[int, ...]:
        """End tokens of the tokenizer, the config and generation_config.json (Qwen lists two)."""
        generation = self.checkpoint.path / "generation_config.json"
        candidates = [
            getattr(self.checkpoint.tokenizer, "eos_token_id", None),
            getattr(self.config, "eos_token_id", None) or getattr(self.text_config, "eos_token_id", None),
            json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None,
        ]
        ids: list[int] = []
        for value in candidates:
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v is not None and int(v) not in ids:
                    ids.append(int(v))
        return tuple(ids)

    def thinking_token_ids(self) -> tuple[int, int] | None:
        """Ids of the tokens that open and close a thinking span; None where the tokenizer lacks either."""
        vocab = self.tokenizer.get_vocab()
        start, end = (vocab.get(marker) for marker in self.thinking_markers)
        return None if start is None or end is None else (int(start), int(end))

    def layout(self, token_ids: list[int], images: list[ImageInputs]) -> PromptLayout:
        """Positions of a prompt; plain 1-D positions unless the family overrides."""
        n = len(token_ids)
        return PromptLayout(token_ids, torch.arange(n), n, self.image_token_id)

    # --- vision side ---------------------------------------------------------------
    @abstractmethod
    def process_image(self, image) -> ImageInputs:
        """A PIL RGB image -> tensors for the vision engine and the expanded placeholder."""

    @abstractmethod
    def build_vision(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
        """The vision engine: ``module(**ImageInputs.tensors) -> [num_tokens, text_hidden]``."""

    def vision_graph(self, vision: nn.Module) -> VisionGraph | None:
        """The exportable graph of ``vision`` (what :meth:`build_vision` built); None keeps
        the vision engine on torch."""
        return None

    @property
    def vision_hidden(self) -> int:
        return int(self.config.vision_config.hidden_size)

    def vision_patches(self, image: ImageInputs) -> int:
        """Patches the vision encoder holds at once for this image (its activation peak)."""
        return image.num_tokens * self.patches_per_token

    patches_per_token: int = 1

    def image_limits(self) -> dict[str, int | None]:
        """The processor's own limits for preflight: max_side, max_pixels, min_side."""
        return {"max_side": None, "max_pixels": None, "min_side": None}


def rename_weights(names, renames: WeightRenames) -> dict[str, str]:
    """Map checkpoint names to canonical ``vision.*`` / ``text.*`` names; unmatched are errors."""
    compiled = [(re.compile(pattern), target) for pattern, target in renames]
    mapping, unmatched = {}, []
    for name in names:
        for pattern, target in compiled:
            if pattern.match(name):
                new = pattern.sub(target, name, count=1)
                if new:
                    mapping[name] = new
                break
        else:
            unmatched.append(name)
    if unmatched:
        raise KeyError(f"weights with no place in this family: {unmatched[:8]}")
    return mapping


def load_module_state(module: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    """Load a module built on the meta device from ``tensors``; strict, so nothing is left random."""
    missing = set(module.state_dict()) - set(tensors)
    buffers = {n for n, _ in module.named_buffers()}
    if missing - buffers:
        raise KeyError(f"checkpoint lacks weights {sorted(missing - buffers)[:8]}")
    module.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    return module
