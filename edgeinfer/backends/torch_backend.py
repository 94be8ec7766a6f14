"""The PyTorch backend: runs our decoder and the family's vision module in-process."""

from __future__ import annotations

import torch

from edgeinfer.models.decoder import Decoder


class TorchDecoderEngine:
    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids)

    @torch.inference_mode()
    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens):
        return self.decoder(inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens)


class TorchVisionEngine:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    @torch.inference_mode()
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(self.module.parameters()).device
        return self.module(**{k: v.to(device) for k, v in tensors.items()})
