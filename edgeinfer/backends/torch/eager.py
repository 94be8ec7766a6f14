"""The PyTorch backend: runs our decoder and the family's vision module in-process."""

from __future__ import annotations

import warnings

import torch

from edgeinfer.models.decoder import Decoder


class TorchDecoderEngine:
    """Index tensors arrive on the CPU; they move to the decoder's device here (a no-op on CPU)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.device = decoder.norm.weight.device

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids.to(self.device, non_blocking=True))

    @torch.inference_mode()
    def step(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        move = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return self.decoder(move(inputs_embeds), move(position_ids), k_pool, v_pool, move(block_tables),
                            move(context_lens), None if image_groups is None else move(image_groups))


def warm_up(fn, device: torch.device, times: int = 2) -> None:
    """Run ``fn`` on a side stream before a capture, so that its first-call work (allocations,
    compilation, autotuning) is not what the graph records."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def capture_graph(fn, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Record ``fn`` (warmed up) in a CUDA graph sharing the memory pool ``pool``; returns the
    graph and ``fn``'s outputs, which each replay overwrites."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def input_signature(tensors: dict[str, torch.Tensor]) -> tuple:
    """Shapes of a vision input, plus the values of small integer tensors (image grids) that
    steer the tower's code: what a compiled tower specialises on."""
    return tuple((name, tuple(t.shape), tuple(t.flatten().tolist()) if not t.is_floating_point() and t.numel() <= 64
                  else None) for name, t in sorted(tensors.items()))


class TorchVisionEngine:
    """The family's vision module. ``compile_for`` readies it for a few input shapes ahead of
    time (a profile's camera sizes): on a GPU, a tower that says nothing in it waits on the
    device (``graph_safe``) is compiled, then captured in a CUDA graph per shape, so a picture
    costs one replay of fused kernels instead of hundreds of launches (the compiled code fuses
    the rotary embedding, the norms and the activations: an H200 encodes a 1024x768 picture
    with Qwen2-VL-2B's tower in 18 ms so, against 27 ms for a graph of the uncompiled tower);
    others are compiled. Other shapes run eagerly, so no request ever waits on a compiler or a capture."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._compiled = None
        self.compiled_signatures: set[tuple] = set()
        self._graphs: dict[tuple, tuple] = {}  # signature -> (graph, static inputs, output)
        self._pool = None
        self.capture_error: str | None = None  # why a graph-safe tower was compiled instead
        self.compile_error: str | None = None  # why a graph-safe tower's graphs hold the uncompiled tower

    @property
    def captured_signatures(self) -> set[tuple]:
        return set(self._graphs)

    @property
    def _device(self) -> torch.device:
        return next(self.module.parameters()).device

    @torch.inference_mode()
    def compile_for(self, inputs: list[dict[str, torch.Tensor]]) -> None:
        """Compile the tower and capture it (graph-safe towers on a GPU), or compile and warm it,
        for each of ``inputs``' signatures."""
        for tensors in inputs:
            signature = input_signature(tensors)
            if getattr(self.module, "graph_safe", False) and self._device.type == "cuda" and self.capture_error is None:
                try:
                    self._graphs[signature] = self._capture_fastest(tensors)
                    continue
                except Exception as exc:  # noqa: BLE001 - the compiled tower is the fallback
                    self.capture_error = f"{type(exc).__name__}: {exc}"[:500]
                    warnings.warn(f"capturing the vision tower failed, compiling it instead: {self.capture_error}")
            self._compile()
            for _ in range(2):
                self._run(self._compiled, tensors)
            self.compiled_signatures.add(signature)

    def _compile(self) -> None:
        if self._compiled is None:  # (a compiled module has no truth value of its own)
            self._compiled = torch.compile(self.module, dynamic=False)

    def release_captures(self) -> int:
        """Drop the captured graphs and their memory (they hold the weights' addresses); the compiled
        tower stays. ``compile_for`` captures them again."""
        dropped = len(self._graphs)
        self._graphs, self._pool = {}, None
        return dropped

    def _capture_fastest(self, tensors: dict[str, torch.Tensor]) -> tuple:
        """The compiled tower captured; the tower as written where compiling it fails."""
        if self.compile_error is None:
            self._compile()
            try:
                return self._capture(self._compiled, tensors)
            except Exception as exc:  # noqa: BLE001 - the uncompiled tower's graph is the fallback
                self.compile_error = f"{type(exc).__name__}: {exc}"[:500]
                warnings.warn(f"compiling the vision tower failed, its graphs hold it uncompiled: {self.compile_error}")
        return self._capture(self.module, tensors)

    def _capture(self, module, tensors: dict[str, torch.Tensor]) -> tuple:
        device = self._device
        static = {k: v.clone() if v.device == device else v for k, v in self._moved(tensors).items()}
        warm_up(lambda: module(**static), device)
        graph, out = capture_graph(lambda: module(**static), self._pool)
        self._pool = graph.pool()
        return graph, static, out

    def _moved(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        host = getattr(self.module, "host_inputs", ())
        device = self._device
        return {k: v if k in host else v.to(device, non_blocking=True) for k, v in tensors.items()}

    def _run(self, module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return module(**self._moved(tensors))

    @torch.inference_mode()
    def encode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        signature = input_signature(tensors)
        captured = self._graphs.get(signature)
        if captured is not None:
            graph, static, out = captured
            host = getattr(self.module, "host_inputs", ())
            for name, value in tensors.items():
                if name not in host:  # host inputs are in the signature: equal by construction
                    static[name].copy_(value, non_blocking=True)
            graph.replay()
            return out.clone()  # the next replay overwrites ``out``
        compiled = self._compiled is not None and signature in self.compiled_signatures
        return self._run(self._compiled if compiled else self.module, tensors)
