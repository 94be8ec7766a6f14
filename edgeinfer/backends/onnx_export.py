"""ONNX export of the two engines, their checks, and the engine folder with its manifest.

``build_engines`` writes ``<root>/<model>/<profile>/{vision,decoder}.onnx`` and
``manifest.json``. TensorRT builds from the same graphs, so they keep a static rank, take
int64 indices, use no sequence ops and stay at opset 18.

The decoder graph is the decoder engine contract of the design: ``inputs_embeds``,
``position_ids``, the KV pools by reference, ``block_tables`` and ``context_lens`` in;
``logits`` of the last position and ``new_k`` / ``new_v`` out. Embedding lookup stays
on the host (the graph starts at ``inputs_embeds``, where image embeddings are merged).
Unlike :meth:`Decoder.forward`, which slices the past to the longest context, the graph
reads every block of the table and masks the slots past each token's position, so no
shape depends on an input's values. It reads the table's blocks with one gather per layer
and pool (a per-layer slice ``pool[layer]`` would be a Gather that copies a whole layer of
the pool every step), and runs the decoder's weights through :class:`GraphLayer`, an
arrangement of ``DecoderLayer.forward`` in about half the nodes.

The vision graph of each family holds the heavy part of its tower; what depends on the
image grid as Python values is computed on the host by :class:`VisionGraph`:

- SmolVLM / Idefics3: tiles + pixel mask -> embeddings, dynamic tile count;
- LLaVA-1.5: crops -> embeddings, dynamic crop count;
- LLaVA-NeXT: crops -> per-crop features in the graph; the any-res packing (unpadding,
  row newlines) runs on the host, as its shapes follow the image size;
- Qwen2-VL / Qwen2.5-VL: flattened patches + rotary position ids + segment (and window)
  boundaries -> merged embeddings, dynamic patch count; the host derives the position
  ids, ``cu_seqlens`` and window order from ``image_grid_thw`` with transformers' own
  functions, and the graph attends within segments through a block-diagonal mask.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.doctor import file_problems, file_sha256  # the same hashes doctor checks manifests with
from edgeinfer.errors import EngineBuildError
from edgeinfer.models.decoder import Decoder, _linear, reshape_tail
from edgeinfer.models.qwen2_vl import vision_attention

OPSET = 18
MANIFEST_SCHEMA = 1
# Bumped whenever the exported graphs change, so that engines built by an older edgeinfer rebuild.
EXPORT_REVISION = 4
MANIFEST = "manifest.json"
DECODER_FILE = "decoder.onnx"
VISION_FILE = "vision.onnx"
ENGINES_ENV = "EDGEINFER_ENGINES"
DECODER_INPUTS = ("inputs_embeds", "position_ids", "k_pool", "v_pool", "block_tables", "context_lens")
DECODER_OUTPUTS = ("logits", "new_k", "new_v")
VISION_OUTPUT = "image_embeds"
# protobuf refuses messages over 2 GiB: larger graphs keep their weights beside them.
EXTERNAL_DATA_BYTES = 1_800_000_000
# fp32 graph vs torch: largest absolute logit difference allowed, relative to the logits' scale.
FP32_TOLERANCE = 1e-3

Precision = Literal["fp32", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "int8")


# --------------------------------------------------------------------------- what a build depends on


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """Everything an ONNX build depends on besides the checkpoint.

    ``profile`` names the profile (``custom`` for an engine configured without one) and
    ``profile_fingerprint`` is :func:`edgeinfer.profiles.profile_fingerprint` of it, None
    for ``custom``. ``precision`` ``int8`` quantizes the decoder's weights.
    """

    profile: str
    profile_fingerprint: str | None
    precision: Precision = "fp32"
    block_size: int = 16
    shapes: dict[str, Any] = field(default_factory=dict)
    opset: int = OPSET

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise EngineBuildError(f"precision {self.precision!r} is not supported by the onnxruntime backend; "
                                   f"choose one of: {', '.join(PRECISIONS)}")

    @classmethod
    def from_profile(cls, profile, precision: str | None = None) -> "BuildSpec":
        """The spec of a DeviceProfile; ``precision`` (a flag) wins over ``build.precision``."""
        from edgeinfer.profiles import profile_fingerprint

        chosen = precision or profile.build.precision
        if chosen not in PRECISIONS:
            raise EngineBuildError(
                f"profile {profile.name!r} asks for build.precision {chosen!r}, which the onnxruntime backend "
                f"does not build; choose one of: {', '.join(PRECISIONS)}",
                fix=f"edgeinfer build --backend onnxruntime --profile {profile.name} --precision fp32")
        if profile.runtime.dtype != "float32":
            raise EngineBuildError(
                f"profile {profile.name!r} runs in {profile.runtime.dtype}; the onnxruntime graphs are float32 "
                f"(int8 quantizes weights only)", fix="--set runtime.dtype=float32")
        shapes = {name: dataclasses.asdict(getattr(profile.build, name)) for name in
                  ("vision_side", "vision_batch", "decoder_batch", "decoder_tokens", "decoder_block_table")}
        return cls(profile.name, profile_fingerprint(profile), chosen, profile.kv.block_size, shapes)

    @classmethod
    def custom(cls, name: str = "custom", block_size: int = 16, precision: str = "fp32") -> "BuildSpec":
        return cls(name, None, precision, block_size)  # type: ignore[arg-type]


def engines_root(root: str | Path | None = None) -> Path:
    """Where built engines live: ``root``, else ``$EDGEINFER_ENGINES``, else ``./engines``."""
    return Path(root if root is not None else os.environ.get(ENGINES_ENV, "engines"))


def engine_dir(root: str | Path | None, model_name: str, profile_name: str) -> Path:
    return engines_root(root) / model_name / profile_name


def build_command(model_dir: str | Path, spec: BuildSpec) -> str:
    profile = "" if spec.profile == "custom" else f" --profile {spec.profile}"
    precision = "" if spec.precision == "fp32" else f" --precision {spec.precision}"
    return f"edgeinfer build --backend onnxruntime --model {model_dir}{profile}{precision}"


# --------------------------------------------------------------------------- hashes and versions


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the checkpoint's config and weight files (cached while they are unchanged)."""
    folder = Path(model_dir).resolve()
    names = ["config.json", *sorted(p.name for p in folder.glob("*.safetensors"))]
    stats = tuple((n, (folder / n).stat().st_size, (folder / n).stat().st_mtime_ns)
                  for n in names if (folder / n).is_file())
    return _fingerprint(str(folder), stats)


@functools.lru_cache(maxsize=32)
def _fingerprint(folder: str, stats: tuple) -> str:
    digest = hashlib.sha256()
    for name, _, _ in stats:
        digest.update(name.encode())
        digest.update(file_sha256(Path(folder) / name).encode())
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import transformers

    import edgeinfer

    return {"edgeinfer": getattr(edgeinfer, "__version__", "0"), "torch": torch.__version__,
            "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}


# --------------------------------------------------------------------------- the decoder graph


def past_rows(block_tables: torch.Tensor, blocks, block_size, kv_heads: int, layers: int) -> list[torch.Tensor]:
    """Per layer, the rows [1, B, W*bs*kvh] of its past in a pool viewed as [layers*blocks*bs*kvh, hd].

    Row ``s * kvh + h`` of a sequence's past is slot ``s`` of K/V head ``h``: one Gather of
    these rows reads a layer's past as the rows :class:`GraphLayer` attends to, copying
    only the blocks of the table (``pool[layer]`` would copy the whole layer first). Each
    layer's rows are the previous layer's plus one layer of the pool: one Add a layer.
    """
    per_block = block_size * kv_heads
    slots = torch.arange(per_block, device=block_tables.device)
    rows = [(block_tables[..., None] * per_block + slots).flatten(1)[None]]
    layer = blocks * per_block
    for _ in range(layers - 1):
        rows.append(rows[-1] + layer)
    return rows


def folded_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size, tokens, heads: int,
                kv_heads: int) -> torch.Tensor:
    """Additive mask [B, T*heads, W*bs*kvh] of the folded attention of :class:`GraphLayer`.

    Query row ``t * heads + h`` (new token ``t``, query head ``h``) may see key row
    ``s * kvh + j`` when slot ``s`` is at most the token's own position, ``context + t``,
    and ``j`` is the K/V head of ``h``. Built once for every layer.
    """
    device = block_tables.device
    rows = torch.arange(tokens * heads, device=device)
    row_token, row_head = rows // heads, (rows % heads) // (heads // kv_heads)
    keys = torch.arange(block_tables.shape[1] * block_size * kv_heads, device=device)
    seen = (keys // kv_heads)[None, None, :] <= (context_lens[:, None] + row_token[None, :])[..., None]
    ok = seen & ((keys % kv_heads)[None, :] == row_head[:, None])[None]
    return torch.where(ok, 0.0, float("-inf"))


def new_rows(context_lens: torch.Tensor, tokens, kv_heads: int) -> torch.Tensor:
    """ScatterND indices [1, B, T*kvh, 3] of the new tokens' K/V rows in a layer's past rows:
    new token ``t`` sits at slot ``context + t`` of its sequence's table."""
    batch = context_lens.shape[0]
    offsets = torch.arange(tokens * kv_heads, device=context_lens.device)
    rows = context_lens[:, None] * kv_heads + offsets  # [B, T*kvh]
    seqs = torch.arange(batch, device=context_lens.device)[:, None].expand_as(rows)
    return torch.stack((torch.zeros_like(rows), seqs, rows), dim=-1)[None]


class _PutRows(torch.autograd.Function):
    """``past`` with the rows at ``index`` (from :func:`new_rows`) replaced by ``rows``,
    exported as one ScatterND, which ONNX Runtime runs in place on the gathered past."""

    @staticmethod
    def forward(ctx, past: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = past.clone()
        out[index[..., 0], index[..., 1], index[..., 2]] = rows
        return out

    @staticmethod
    def symbolic(g, past, index, rows):
        return g.op("ScatterND", past, index, rows)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, hd] -> tables [B, T, heads + 2*kvh, hd] over the q|k|v heads of a layer.

    ``x * cos + x[..., rotation] * sin`` is RoPE on the q and k heads (``rotate_half``'s
    sign is in ``sin``), scales q by the attention scale, and leaves the v heads as they are.
    """
    half = head_dim // 2
    cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    scale = [head_dim ** -0.5] * heads + [1.0] * kv_heads + [0.0] * kv_heads
    per_head = torch.tensor(scale, dtype=cos.dtype, device=cos.device)[:, None]
    keep_v = torch.tensor([0.0] * (heads + kv_heads) + [1.0] * kv_heads, dtype=cos.dtype, device=cos.device)[:, None]
    return cos * per_head + keep_v, sin * per_head


class GraphLayer(nn.Module):
    """A decoder layer as the graph runs it: the arithmetic of ``DecoderLayer.forward`` with
    its own weights, in about half the nodes, because ONNX Runtime pays per node and per copy.

    Activations carry a leading axis of 1, ``[1, B, T, ...]``, so that the layers' new K/V
    concatenate into the ``[layers, B, T, kvh, hd]`` outputs without a node a layer. RoPE,
    the attention scale and the q/k/v split take one pass over the heads of the fused
    projection (:func:`rope_tables`). Attention folds the query heads into rows
    ``[1, B, T*heads, hd]`` against the table's K/V rows ``[1, B, W*bs*kvh, hd]`` straight
    from the gather (:func:`past_rows`): the past is never transposed nor concatenated,
    the new tokens' rows are written over their own (not yet filled) slots of the table
    (:class:`_PutRows`), and a query row's products with the other K/V heads' rows (a few
    thousand multiply-adds) are masked out by :func:`folded_mask`.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        half = layer.cfg.head_dim // 2
        self.rotation = list(range(half, 2 * half)) + list(range(half))

    def forward(self, x, cos, sin, past_k, past_v, mask, index):
        """x [1,B,T,H]; cos/sin from :func:`rope_tables`; past_k/v [1,B,W*bs*kvh,hd]; mask from
        :func:`folded_mask`; index from :func:`new_rows`. Returns (x, k, v), k/v [1,B,T,kvh,hd]."""
        layer, cfg = self.layer, self.layer.cfg
        heads = reshape_tail(_linear(layer.input_norm(x), layer.qkv_t, layer.qkv_bias), 3,
                             cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        heads = heads * cos + heads[..., torch.tensor(self.rotation)] * sin
        q, k, v = heads.split((cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads), dim=3)
        q = reshape_tail(q, 2, -1, cfg.head_dim)
        keys = _PutRows.apply(past_k, index, reshape_tail(k, 2, -1, cfg.head_dim))
        values = _PutRows.apply(past_v, index, reshape_tail(v, 2, -1, cfg.head_dim))
        probs = torch.softmax(q @ keys.transpose(2, 3) + mask, dim=-1)
        attn = reshape_tail(probs @ values, 2, -1, cfg.q_size)
        x = x + _linear(attn, layer.o_t, layer.o_bias)
        gate_up = _linear(layer.post_attention_norm(x), layer.gate_up_t, layer.gate_up_bias)
        gate, up = gate_up[..., :cfg.intermediate_size], gate_up[..., cfg.intermediate_size:]
        x = x + _linear(F.silu(gate) * up, layer.down_t, layer.down_bias)
        return x, k, v


class DecoderGraph(nn.Module):
    """The decoder engine step with value-independent shapes, over :class:`GraphLayer` views
    of the decoder's layers, then the decoder's own final norm and head."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder
        self.layers = nn.ModuleList(GraphLayer(layer) for layer in decoder.layers)

    def forward(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens):
        decoder, cfg = self.decoder, self.decoder.cfg
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tokens = inputs_embeds.shape[1]
        mask = folded_mask(block_tables, context_lens, k_pool.shape[2], tokens, heads, kv_heads)
        index = new_rows(context_lens, tokens, kv_heads)
        cos, sin = rope_tables(*decoder.rope(position_ids, inputs_embeds.dtype), heads, kv_heads, hd)
        rows = past_rows(block_tables, k_pool.shape[1], k_pool.shape[2], kv_heads, cfg.num_layers)
        flat_k, flat_v = k_pool.reshape(-1, hd), v_pool.reshape(-1, hd)  # views: the pools are not copied
        x, new_k, new_v = inputs_embeds[None], [], []
        for layer, past in zip(self.layers, rows):
            x, k, v = layer(x, cos, sin, flat_k[past], flat_v[past], mask, index)
            new_k.append(k)
            new_v.append(v)
        logits = decoder.norm(x[0, :, -1]) @ decoder.lm_head_t
        return logits, torch.cat(new_k), torch.cat(new_v)


def decoder_axes(mrope: bool) -> dict[str, dict[int, str]]:
    positions = {1: "batch", 2: "tokens"} if mrope else {0: "batch", 1: "tokens"}
    pool = {1: "blocks", 2: "block_size"}
    return {"inputs_embeds": {0: "batch", 1: "tokens"}, "position_ids": positions, "k_pool": pool, "v_pool": pool,
            "block_tables": {0: "batch", 1: "table"}, "context_lens": {0: "batch"}, "logits": {0: "batch"},
            "new_k": {1: "batch", 2: "tokens"}, "new_v": {1: "batch", 2: "tokens"}}


def decoder_example(decoder: Decoder, *, batch: int, tokens: int, block_size: int, context: list[int],
                    num_blocks: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of one step: token embeddings, positions after each context, a random pool."""
    cfg = decoder.cfg
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen)
    with torch.no_grad():
        embeds = decoder.embed_tokens(ids).float().contiguous()
    lens = torch.tensor(context, dtype=torch.int64)
    positions = lens[:, None] + torch.arange(tokens)
    if cfg.mrope_section is not None:
        positions = positions.expand(3, batch, tokens)
    width = max(1, -(-(max(context) + tokens) // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return {"inputs_embeds": embeds, "position_ids": positions.contiguous(),
            "k_pool": torch.randn(shape, generator=gen), "v_pool": torch.randn(shape, generator=gen),
            "block_tables": tables.contiguous(), "context_lens": lens}


def export_decoder(decoder: Decoder, path: Path, block_size: int, opset: int = OPSET) -> None:
    example = decoder_example(decoder, batch=2, tokens=3, block_size=block_size, context=[5, 2])
    mrope = decoder.cfg.mrope_section is not None
    with torch.no_grad(), _quiet_exporter():
        torch.onnx.export(DecoderGraph(decoder).eval(), tuple(example.values()), str(path), dynamo=False,
                          opset_version=opset, input_names=list(DECODER_INPUTS),
                          output_names=list(DECODER_OUTPUTS), dynamic_axes=decoder_axes(mrope))
    finalize_graph(path)


# --------------------------------------------------------------------------- the vision graphs


class VisionGraph:
    """One family's vision engine as a graph: which module is exported, its inputs, and the
    host steps around it. The default is the adapter's vision module as it is, whose
    inputs are ``ImageInputs.tensors`` with a dynamic first axis.

    ``independent_rows``: the first axis holds independent pictures (tiles, crops) whose
    outputs are concatenated in order, so the runtime may run them one at a time.
    """

    independent_rows = True

    def __init__(self, vision: nn.Module, input_names: tuple[str, ...], axis_name: str) -> None:
        self.vision = vision
        self.input_names = input_names
        self.axis_name = axis_name

    def module(self) -> nn.Module:
        return self.vision

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {**{name: {0: self.axis_name} for name in self.input_names}, VISION_OUTPUT: {0: "image_tokens"}}

    def feeds(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ImageInputs.tensors -> the graph's inputs."""
        return {name: tensors[name] for name in self.input_names}

    def finish(self, output: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The graph's output -> the image embeddings [num_tokens, text_hidden]."""
        return output

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """Changes to the module that hold only while it is traced."""
        yield


class CropFeatures(nn.Module):
    """LLaVA-NeXT's tower + projector over crops: [n, 3, S, S] -> [n, tokens, text_hidden]."""

    def __init__(self, vision: nn.Module) -> None:
        super().__init__()
        self.vision = vision

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision.crop_features(pixel_values)


class AnyResVisionGraph(VisionGraph):
    """LLaVA-NeXT: crop features in the graph; the any-res packing, whose shapes follow the
    image size, on the host through the encoder's own ``forward``."""

    def module(self) -> nn.Module:
        return CropFeatures(self.vision)

    def dynamic_axes(self):
        return {"pixel_values": {0: "crops"}, VISION_OUTPUT: {0: "crops"}}

    def finish(self, output, tensors):
        packer = copy.copy(self.vision)  # shares the weights; only crop_features is replaced
        packer.crop_features = lambda pixel_values: output.to(pixel_values.dtype)
        with torch.no_grad():
            return packer(tensors["pixel_values"], tensors["image_size"])


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
    independent_rows = False  # the patches of an image attend to each other

    def __init__(self, vision: nn.Module) -> None:
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

    @contextlib.contextmanager
    def exporting(self):
        attentions = [block.attn for block in self.vision.visual.blocks]
        for attn in attentions:
            attn.forward = types.MethodType(_segment_attention, attn)
        try:
            yield
        finally:
            for attn in attentions:
                del attn.forward


def vision_graph_for(model) -> VisionGraph | None:
    """The vision graph of a loaded model's family; None keeps its vision engine on torch."""
    name = type(model.vision).__name__
    if name == "TiledVisionEncoder":
        return VisionGraph(model.vision, ("pixel_values", "pixel_attention_mask"), "tiles")
    if name == "AnyResVisionEncoder":
        return AnyResVisionGraph(model.vision, ("pixel_values",), "crops")
    if name == "LlavaVisionEncoder":
        return VisionGraph(model.vision, ("pixel_values",), "crops")
    if name == "QwenVisionEncoder":
        return QwenVisionGraph(model.vision)
    return None


def sample_images(seed: int = 0) -> list:
    """Two noise pictures of different shapes: the export example and a second grid for the check."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((160, 120), (96, 200))]


def export_vision(graph: VisionGraph, example: dict[str, torch.Tensor], path: Path, opset: int = OPSET) -> None:
    feeds = graph.feeds(example)
    with graph.exporting(), torch.no_grad(), _quiet_exporter():
        torch.onnx.export(graph.module().eval(), tuple(feeds.values()), str(path), dynamo=False,
                          opset_version=opset, input_names=list(feeds), output_names=[VISION_OUTPUT],
                          dynamic_axes=graph.dynamic_axes())
    finalize_graph(path)


# --------------------------------------------------------------------------- graph hygiene


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The tracer warns at every Python value it freezes; the numerical checks after export
    are what tell whether a frozen value mattered."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def finalize_graph(path: Path) -> None:
    """Fix what the TorchScript exporter gets wrong and move large weights beside the graph.

    The exporter types some index tensors float (a ``torch.full`` without a dtype feeding
    ``torch.where``); Gather takes integers only, so such indices get an exact Cast to int64.
    """
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path))
    types_ = value_types(model)
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)
    nodes = []
    for node in model.graph.node:
        if node.op_type == "Gather" and types_.get(node.input[1]) in floats:
            index = node.input[1] + "_int64"
            nodes.append(helper.make_node("Cast", [node.input[1]], [index], to=TensorProto.INT64,
                                          name=f"{node.name}_index_to_int64"))
            node.input[1] = index
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    save_graph(model, path)


def value_types(model) -> dict[str, int]:
    """Element type of every value, inferred on a copy whose weights are typed inputs
    without data (inference over the real model would copy every weight)."""
    import onnx
    from onnx import helper

    graph = model.graph
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer]
    light = helper.make_model(
        helper.make_graph(list(graph.node), "types", [*graph.input, *weights], list(graph.output)),
        opset_imports=list(model.opset_import))
    inferred = onnx.shape_inference.infer_shapes(light).graph
    return {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.input, *inferred.output]}


def save_graph(model, path: Path) -> None:
    import onnx

    external = model.ByteSize() > EXTERNAL_DATA_BYTES
    for stale in path.parent.glob(path.name + ".data"):
        stale.unlink()
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=path.name + ".data")


def graph_files(folder: Path, name: str) -> list[str]:
    """The graph file and its external weights, if any."""
    return [n for n in (name, name + ".data") if (folder / n).is_file()]


def check_graph(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise EngineBuildError(f"onnx.checker rejects the graph: {exc}", artifact=str(path)) from exc


def graph_io(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Names, element types and shapes (symbolic where dynamic) of a graph's inputs and outputs."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def describe(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            out[v.name] = {"dtype": onnx.TensorProto.DataType.Name(t.elem_type).lower(), "shape": dims}
        return out

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


# --------------------------------------------------------------------------- numerical checks


def cpu_session(path: Path, threads: int | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_decoder(decoder: Decoder, path: Path, block_size: int) -> dict[str, float]:
    """Largest differences between the graph and the torch decoder on a prefill and a batched decode step."""
    session = cpu_session(path)
    cases = {"prefill": {"batch": 1, "tokens": 6, "context": [0]},
             "prefill_after_past": {"batch": 1, "tokens": 4, "context": [9]},
             "batched_decode": {"batch": 3, "tokens": 1, "context": [11, 3, 1]}}
    report = {}
    for name, case in cases.items():
        inputs = decoder_example(decoder, block_size=block_size, seed=len(name), **case)
        with torch.no_grad():
            expected = decoder(**inputs)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        scale = float(expected[0].abs().max())
        report[name] = max(float((torch.from_numpy(g) - e).abs().max()) for g, e in zip(got, expected))
        report[name + "_argmax_equal"] = bool((torch.from_numpy(got[0]).argmax(-1) == expected[0].argmax(-1)).all())
        report["logit_scale"] = max(report.get("logit_scale", 0.0), scale)
    return report


def check_vision(graph: VisionGraph, adapter, path: Path) -> dict[str, float]:
    session = cpu_session(path)
    wanted = [i.name for i in session.get_inputs()]
    diffs = []
    for image in sample_images():
        tensors = adapter.process_image(image).tensors
        with torch.no_grad():
            expected = graph.vision(**tensors).float()
        feeds = graph.feeds(tensors)
        output = torch.from_numpy(session.run(None, {k: feeds[k].numpy() for k in wanted})[0])
        got = graph.finish(output, tensors).float()
        if got.shape != expected.shape:
            raise EngineBuildError(f"vision graph gives {tuple(got.shape)} for an image torch encodes as "
                                   f"{tuple(expected.shape)}", artifact=str(path))
        diffs.append(float((got - expected).abs().max()))
    return {"max_abs_diff": max(diffs)}


# --------------------------------------------------------------------------- int8


def quantize_decoder(source: Path, target: Path, keep_head_fp32: bool = False) -> dict[str, Any]:
    """Dynamic int8 quantization of the decoder's MatMul weights, per output channel;
    activations stay float and are quantized per step. The vocabulary projection is
    quantized too unless ``keep_head_fp32``: at SmolVLM-256M's shapes it is a fifth of the
    weights, and a decode step on a CPU is bound by the bytes of weights it reads."""
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source), load_external_data=False)
    head = [n.name for n in model.graph.node if n.op_type == "MatMul" and DECODER_OUTPUTS[0] in n.output]
    excluded = head if keep_head_fp32 else []
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the quantizer advises its pre-processing pass on the root logger
    try:
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"], nodes_to_exclude=excluded,
                         use_external_data_format=(source.parent / (source.name + ".data")).is_file())
    finally:
        logging.disable(previous)
    return {"method": "onnxruntime.quantization.quantize_dynamic", "weights": "int8 per channel",
            "activations": "dynamic (per step)", "ops": ["MatMul"], "excluded": excluded,
            "vocab_projection": "fp32" if keep_head_fp32 else "int8"}


# --------------------------------------------------------------------------- manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of an engine folder; None when absent. A corrupt one is an error naming it."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineBuildError(f"corrupt manifest ({exc})", artifact=str(path)) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("fingerprint"), dict):
        raise EngineBuildError("corrupt manifest (no fingerprint object)", artifact=str(path))
    return manifest


def stale_reasons(manifest: dict[str, Any], folder: Path, spec: BuildSpec, model_fp: str) -> list[str]:
    """Why the engines in ``folder`` do not fit this checkpoint and spec; each names its artifact."""
    reasons = []
    built = manifest.get("fingerprint", {})
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("backend") != "onnxruntime":
        reasons.append(f"{folder / MANIFEST}: not an onnxruntime manifest of schema {MANIFEST_SCHEMA}")
    if built.get("model") != model_fp:
        reasons.append(f"{folder / MANIFEST}: built from other weights or config (model fingerprint changed)")
    if built.get("profile") != spec.profile_fingerprint or manifest.get("profile") != spec.profile:
        reasons.append(f"{folder / MANIFEST}: profile {spec.profile!r} changed")
    if manifest.get("precision") != spec.precision:
        reasons.append(f"{folder / MANIFEST}: precision {manifest.get('precision')} -> {spec.precision}")
    if manifest.get("export_revision") != EXPORT_REVISION:
        reasons.append(f"{folder / MANIFEST}: graphs of export revision {manifest.get('export_revision')}, "
                       f"this edgeinfer exports revision {EXPORT_REVISION}")
    if manifest.get("opset") != spec.opset:
        reasons.append(f"{folder / MANIFEST}: opset {manifest.get('opset')} -> {spec.opset}")
    return reasons + file_problems(folder, manifest.get("files") or {})


def engine_problems(folder: Path, spec: BuildSpec, model_fp: str) -> list[str]:
    """[] when ``folder`` holds engines that fit; otherwise what is missing, stale or corrupt."""
    try:
        manifest = read_manifest(folder)
    except EngineBuildError as exc:
        return [str(exc)]
    if manifest is None:
        return [f"{folder / MANIFEST}: missing (not built)"]
    return stale_reasons(manifest, folder, spec, model_fp)


# --------------------------------------------------------------------------- the build


@dataclass(frozen=True, slots=True)
class BuildResult:
    folder: Path
    manifest: dict[str, Any]
    skipped: bool
    reasons: tuple[str, ...] = ()  # why it was (re)built


class Steps:
    """Build progress: a rich bar on stderr, one advance per step."""

    def __init__(self, total: int, label: str, show: bool = True) -> None:
        self.total, self.label, self.show = total, label, show
        self._progress = None
        self._task = None

    def __enter__(self) -> "Steps":
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True))
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def step(self, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"{self.label}: {description}")

    def done(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)


def build_engines(model, spec: BuildSpec, root: str | Path | None = None, *, force: bool = False,
                  progress: bool = True) -> BuildResult:
    """Export, check and write the engines of a loaded model (``edgeinfer.models.loader.LoadedModel``).

    Skipped when the folder's manifest still matches the checkpoint and ``spec``. The folder
    is written whole in a temporary sibling and moved into place, so a failed build leaves
    the previous engines (or nothing) behind, never half of a new one.
    """
    model_dir = Path(model.adapter.checkpoint.path).resolve()
    folder = engine_dir(root, model.name, spec.profile)
    model_fp = model_fingerprint(model_dir)
    reasons = engine_problems(folder, spec, model_fp)
    if not reasons and not force:
        return BuildResult(folder, read_manifest(folder) or {}, skipped=True)
    if model.dtype != torch.float32 or model.decoder.lm_head_t.device.type != "cpu":
        raise EngineBuildError(f"the graphs are exported from float32 weights on the CPU, this model is "
                               f"{model.dtype} on {model.decoder.lm_head_t.device}", artifact=str(folder),
                               fix=build_command(model_dir, spec))
    graph = vision_graph_for(model)
    steps = 3 + (graph is not None) * 2 + (spec.precision == "int8")
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.profile}-", dir=folder.parent))
    try:
        with Steps(steps, f"building {model.name}/{spec.profile}", progress) as bar:
            manifest = _build_into(work, model, model_dir, model_fp, spec, graph, bar)
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return BuildResult(folder, manifest, skipped=False, reasons=tuple(reasons))


def _build_into(work: Path, model, model_dir: Path, model_fp: str, spec: BuildSpec, graph: VisionGraph | None,
                bar: Steps) -> dict[str, Any]:
    engines: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    if graph is not None:
        bar.step("exporting the vision engine")
        example = model.adapter.process_image(sample_images()[0]).tensors
        _run_export(lambda: export_vision(graph, example, work / VISION_FILE, spec.opset), work / VISION_FILE)
        bar.done()
        bar.step("checking the vision engine")
        check_graph(work / VISION_FILE)
        checks["vision"] = check_vision(graph, model.adapter, work / VISION_FILE)
        _require_close("vision", checks["vision"]["max_abs_diff"], 1.0, work / VISION_FILE)
        engines["vision"] = {"file": VISION_FILE, "runtime": "onnxruntime", "family_graph": type(graph).__name__,
                             **graph_io(work / VISION_FILE)}
        bar.done()
    else:
        engines["vision"] = {"file": None, "runtime": "torch",
                             "reason": f"{type(model.vision).__name__} has no ONNX graph in edgeinfer yet; "
                                       "the vision engine runs on torch"}
    bar.step("exporting the decoder engine")
    fp32 = work / (DECODER_FILE if spec.precision == "fp32" else "decoder.fp32.onnx")
    _run_export(lambda: export_decoder(model.decoder, fp32, spec.block_size, spec.opset), fp32)
    bar.done()
    bar.step("checking the decoder engine")
    check_graph(fp32)
    checks["decoder"] = check_decoder(model.decoder, fp32, spec.block_size)
    worst = max(v for k, v in checks["decoder"].items() if isinstance(v, float) and k != "logit_scale")
    _require_close("decoder", worst, checks["decoder"]["logit_scale"], fp32)
    bar.done()
    quantization = None
    if spec.precision == "int8":
        bar.step("quantizing the decoder to int8")
        quantization = quantize_decoder(fp32, work / DECODER_FILE)
        for name in graph_files(work, fp32.name):
            (work / name).unlink()
        check_graph(work / DECODER_FILE)
        quantization["check"] = check_decoder(model.decoder, work / DECODER_FILE, spec.block_size)
        bar.done()
    engines["decoder"] = {"file": DECODER_FILE, "runtime": "onnxruntime", "precision": spec.precision,
                          "quantization": quantization, "embedding": "host (the graph starts at inputs_embeds)",
                          **graph_io(work / DECODER_FILE)}
    bar.step("writing the manifest")
    manifest = _manifest(work, model, model_dir, model_fp, spec, engines, checks)
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    bar.done()
    return manifest


def _run_export(export: Callable[[], None], path: Path) -> None:
    try:
        export()
    except EngineBuildError:
        raise
    except Exception as exc:  # the exporter raises many unrelated types
        raise EngineBuildError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}", artifact=path.name) from exc


def _require_close(name: str, diff: float, scale: float, path: Path) -> None:
    limit = FP32_TOLERANCE * max(1.0, scale)
    if not diff <= limit:
        raise EngineBuildError(f"the {name} graph differs from torch by {diff:.3g} (limit {limit:.3g})",
                               artifact=str(path))


def _manifest(work: Path, model, model_dir: Path, model_fp: str, spec: BuildSpec, engines: dict,
              checks: dict) -> dict[str, Any]:
    files = [n for f in (VISION_FILE, DECODER_FILE) for n in graph_files(work, f)]
    hashes = {name: file_sha256(work / name, remember=True) for name in files}
    cfg = model.decoder.cfg
    return {
        "schema": MANIFEST_SCHEMA,
        "backend": "onnxruntime",
        "model": model.name,
        "model_dir": str(model_dir),
        "architecture": list(getattr(model.adapter.config, "architectures", None) or []),
        "profile": spec.profile,
        "precision": spec.precision,
        "opset": spec.opset,
        "export_revision": EXPORT_REVISION,
        "fingerprint": {"tensorrt": None, "sm": None, "profile": spec.profile_fingerprint, "model": model_fp,
                        "onnx": {n: hashes[n] for n in (VISION_FILE, DECODER_FILE) if n in hashes}},
        "files": hashes,
        "engines": engines,
        "decoder": {"layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                    "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                    "mrope": cfg.mrope_section is not None, "kv_dtype": "float32"},
        "shapes": {"block_size": spec.block_size, "profile": spec.shapes},
        "checks": checks,
        "versions": library_versions(),
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def ensure_engines(model, profile, config, root: str | Path | None = None) -> BuildResult:
    """The engines ``Engine.load`` runs: built from ``profile`` (a DeviceProfile, or None for an
    engine configured without one), rebuilt with a progress bar when missing or stale."""
    spec = BuildSpec.from_profile(profile) if profile is not None else \
        BuildSpec.custom(config.profile_name, config.block_size)
    result = build_engines(model, spec, root)
    if not result.skipped and result.reasons:
        import sys

        print(f"built {result.folder}, because " + "; ".join(result.reasons), file=sys.stderr)
    return result
