"""The two engines as ONNX-exportable graphs.

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
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.models.decoder import Decoder, _linear, reshape_tail
from edgeinfer.models.qwen2_vl import vision_attention

DECODER_INPUTS = ("inputs_embeds", "position_ids", "k_pool", "v_pool", "block_tables", "context_lens")
DECODER_OUTPUTS = ("logits", "new_k", "new_v")
VISION_OUTPUT = "image_embeds"


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


