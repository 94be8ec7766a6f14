"""The PyTorch backend: runs our decoder and the family's vision module in-process."""

from __future__ import annotations

import torch

from edgeinfer.models.decoder import Decoder


class TorchDecoderEngine:
    """Index tensors arrive on the CPU; they move to the decoder's device here (a no-op on CPU)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.device = decoder.lm_head_t.device

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids.to(self.device, non_blocking=True))

    @torch.inference_mode()
    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens):
        move = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return self.decoder(move(inputs_embeds), move(position_ids), k_pool, v_pool, move(block_tables),
                            move(context_lens))


class TorchVisionEngine:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    @torch.inference_mode()
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(self.module.parameters()).device
        return self.module(**{k: v.to(device) for k, v in tensors.items()})
