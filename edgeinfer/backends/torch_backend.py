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


def input_signature(tensors: dict[str, torch.Tensor]) -> tuple:
    """Shapes of a vision input, plus the values of small integer tensors (image grids) that
    steer the tower's code: what a compiled tower specialises on."""
    return tuple((name, tuple(t.shape), tuple(t.flatten().tolist()) if not t.is_floating_point() and t.numel() <= 64
                  else None) for name, t in sorted(tensors.items()))


class TorchVisionEngine:
    """The family's vision module. ``compile_for`` compiles it for a few input shapes ahead of
    time (a profile's camera sizes); other shapes run eagerly, so no request ever waits on the
    compiler."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._compiled = None
        self.compiled_signatures: set[tuple] = set()

    @torch.inference_mode()
    def compile_for(self, inputs: list[dict[str, torch.Tensor]]) -> None:
        """Compile and warm the tower for each of ``inputs``' signatures (twice: compile, then run)."""
        self._compiled = self._compiled or torch.compile(self.module, dynamic=False)
        for tensors in inputs:
            for _ in range(2):
                self._run(self._compiled, tensors)
            self.compiled_signatures.add(input_signature(tensors))

    def _run(self, module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(self.module.parameters()).device
        return module(**{k: v.to(device, non_blocking=True) for k, v in tensors.items()})

    @torch.inference_mode()
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        compiled = self._compiled is not None and input_signature(tensors) in self.compiled_signatures
        return self._run(self._compiled if compiled else self.module, tensors)
