"""What a family declares about its vision engine as an exportable graph.

A family adapter's :meth:`~edgeinfer.models.base.FamilyAdapter.vision_graph` returns a
:class:`VisionGraph`: the module to export, its inputs, and the host steps around it.
What depends on the image grid as Python values (or on how a torch version would trace
it) is computed on the host by :meth:`VisionGraph.feeds` and enters the graph as an
input. The export itself (``torch.onnx.export``, checks, fixes) belongs to the backends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

VISION_OUTPUT = "image_embeds"


class VisionGraph:
    """One family's vision engine as a graph. The default is the vision module as it is,
    whose inputs are ``ImageInputs.tensors`` named ``input_names`` with a dynamic first
    axis named ``axis_name``.

    ``independent_rows``: the first axis holds independent pictures (tiles, crops) whose
    outputs are concatenated in order, so the runtime may run them one at a time.
    """

    independent_rows = True

    def __init__(self, vision: nn.Module, input_names: tuple[str, ...], axis_name: str) -> None:
        self.vision = vision
        self.input_names = input_names
        self.axis_name = axis_name

    def module(self) -> nn.Module:
        """The module exported: ``module(*feeds(tensors).values()) -> [rows, text_hidden]``."""
        return self.vision

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {**{name: {0: self.axis_name} for name in self.input_names}, VISION_OUTPUT: {0: "image_tokens"}}

    def feeds(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ImageInputs.tensors -> the graph's inputs, in the order the graph takes them."""
        return {name: tensors[name] for name in self.input_names}

    def finish(self, output: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The graph's output -> the image embeddings [num_tokens, text_hidden]."""
        return output

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """Changes to the module that hold only while it is traced."""
        yield

    def fused_attention(self) -> AttentionShape | None:
        """The tower's attention, where an int8 build may fuse it into ONNX Runtime's attention
        operator (only towers whose fused graph was measured and checked declare it)."""
        return None


@dataclass(frozen=True)
class AttentionShape:
    """What ONNX Runtime's attention fusion needs of a tower: its heads and hidden size, and the
    graph input (if any) that masks keys: [rows, positions], true where a position is kept."""

    heads: int
    hidden: int
    key_padding_mask: str | None = None
