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

Each family declares its vision graph (:class:`~edgeinfer.models.export.VisionGraph`)
through its adapter's ``vision_graph``: the heavy part of its tower in the graph, what
depends on the image grid as Python values computed on the host:

- SmolVLM / Idefics3 (``models/idefics3.py``): tiles + patch mask + patch position ids ->
  embeddings, dynamic tile count;
- LLaVA-1.5 (``models/llava.py``): crops -> embeddings, dynamic crop count;
- LLaVA-NeXT (``models/llava.py``): crops -> per-crop features in the graph; the any-res
  packing (unpadding, row newlines) runs on the host, as its shapes follow the image size;
- Qwen2-VL / Qwen2.5-VL (``models/qwen2_vl.py``): flattened patches + rotary position ids +
  segment (and window) boundaries -> merged embeddings, dynamic patch count.

Gemma 3's decoder graph takes one more input, ``image_groups`` [B, T] (each new token's
image run, -1 for text; :func:`decoder_inputs`), so that an image's tokens see each other,
and its sliding layers attend under a second mask that also bounds the past to the window.

Gemma 4's layers differ in head size and K/V head count, the last ones attend to an earlier
layer's K/V, and each adds a per-layer input looked up by token id: its graph
(:class:`Gemma4DecoderGraph`, chosen by :func:`decoder_graph`) runs the family's own
``Gemma4Decoder.run_layers`` over the whole blocks of the table, reading each layer's past
with one gather of the flattened pool, with an attention the exporter can write
(:func:`grouped_attention`). Its inputs and outputs are the contract's, with embedding rows
that carry the token id (``models/gemma4.py``) and ``image_groups`` where the checkpoint's
images attend both ways.
"""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.models.decoder import (
    Decoder,
    _linear,
    _normed,
    reshape_tail,
    split_visual_additions,
    whole_block_slots_and_mask,
)
from edgeinfer.models.export import VISION_OUTPUT, VisionGraph
from edgeinfer.models.gemma4 import Gemma4Decoder

__all__ = ["DECODER_INPUTS", "DECODER_OUTPUTS", "VISION_OUTPUT", "DecoderGraph", "Gemma4DecoderGraph", "VisionGraph",
           "decoder_axes", "decoder_example", "decoder_graph", "vision_graph_for"]

DECODER_INPUTS = ("inputs_embeds", "position_ids", "k_pool", "v_pool", "block_tables", "context_lens")
DECODER_OUTPUTS = ("logits", "new_k", "new_v")
IMAGE_GROUPS = "image_groups"


def decoder_inputs(cfg) -> tuple[str, ...]:
    """The decoder graph's inputs for a decoder config: the contract's, plus ``image_groups``
    where images attend to themselves both ways."""
    return DECODER_INPUTS + ((IMAGE_GROUPS,) if cfg.bidirectional_images else ())


# --------------------------------------------------------------------------- the decoder graph


def past_rows(block_tables: torch.Tensor, blocks, block_size, kv_heads: int, layers: int) -> list[torch.Tensor]:
    """Per layer, the rows [1, B, kvh, W*bs] of its past in a pool viewed as [layers*blocks*bs*kvh, hd].

    Row ``[h, s]`` of a sequence's past is slot ``s`` of K/V head ``h`` (pool row ``s * kvh + h``
    of the slot's block): one Gather of these rows reads a layer's past head-major, as
    :class:`GraphLayer` attends to it, copying only the blocks of the table (``pool[layer]``
    would copy the whole layer first). Each layer's rows are the previous layer's plus one
    layer of the pool: one Add a layer.
    """
    per_block = block_size * kv_heads
    slots = torch.arange(block_size, device=block_tables.device) * kv_heads
    heads = torch.arange(kv_heads, device=block_tables.device)[:, None]
    first = (block_tables[..., None] * per_block + slots).flatten(1)  # [B, W*bs]: head 0 of every slot
    rows = [(first[:, None, :] + heads)[None]]
    layer = blocks * per_block
    for _ in range(layers - 1):
        rows.append(rows[-1] + layer)
    return rows


def grouped_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size, tokens, heads: int,
                 kv_heads: int, image_groups: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
    """Additive mask [B, 1, T*groups, W*bs] of :class:`GraphLayer`'s attention, the same for
    every K/V head (``groups = heads / kvh`` query heads share one).

    Query row ``t * groups + g`` (new token ``t``) may see slot ``s`` when ``s`` is at most the
    token's own position, ``context + t``. Built once for every layer (once more for sliding
    layers). With ``image_groups`` [B, T] a new token also sees the new tokens of its own
    image run; with a ``window`` only the slots less than ``window`` before it.
    """
    device = block_tables.device
    groups = heads // kv_heads
    row_token = torch.arange(tokens * groups, device=device) // groups
    key_slot = torch.arange(block_tables.shape[1] * block_size, device=device)
    query_slot = (context_lens[:, None] + row_token[None, :])[..., None]  # [B, T*groups, 1]
    seen = key_slot[None, None, :] <= query_slot
    if image_groups is not None:
        seen = seen | _same_image(image_groups, context_lens, key_slot, row_token, tokens)
    if window is not None:
        seen = seen & (key_slot[None, None, :] > query_slot - window)
    return torch.where(seen, 0.0, float("-inf"))[:, None]


def _same_image(groups: torch.Tensor, context_lens: torch.Tensor, key_slot: torch.Tensor, row_token: torch.Tensor,
                tokens) -> torch.Tensor:
    """[B, rows, K] bool: key slot is a new token of the query row's image run."""
    new_index = key_slot[None, :] - context_lens[:, None]  # [B, K] which new token a slot holds
    is_new = (new_index >= 0) & (new_index < tokens)
    key_group = groups.gather(1, torch.where(is_new, new_index, torch.zeros_like(new_index)))
    row_group = groups[:, row_token]  # [B, rows]
    return is_new[:, None, :] & (key_group[:, None, :] == row_group[..., None]) & (row_group[..., None] >= 0)


def new_rows(context_lens: torch.Tensor, tokens, kv_heads: int) -> torch.Tensor:
    """ScatterND indices [1, B, kvh, T, 4] of the new tokens' K/V rows in a layer's past
    [1, B, kvh, W*bs, hd]: new token ``t`` sits at slot ``context + t`` of its sequence's table."""
    batch, device = context_lens.shape[0], context_lens.device
    slots = (context_lens[:, None] + torch.arange(tokens, device=device))[:, None, :]  # [B, 1, T]
    shape = (batch, kv_heads, slots.shape[-1])
    seqs = torch.arange(batch, device=device)[:, None, None].expand(shape)
    heads = torch.arange(kv_heads, device=device)[None, :, None].expand(shape)
    return torch.stack((torch.zeros_like(seqs), seqs, heads, slots.expand(shape)), dim=-1)[None]


class _PutRows(torch.autograd.Function):
    """``past`` with the rows at ``index`` (from :func:`new_rows`) replaced by ``rows``,
    exported as one ScatterND, which ONNX Runtime runs in place on the gathered past."""

    @staticmethod
    def forward(ctx, past: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = past.clone()
        out[tuple(index.unbind(-1))] = rows
        return out

    @staticmethod
    def symbolic(g, past, index, rows):
        return g.op("ScatterND", past, index, rows)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, hd] -> tables [B, T, heads + 2*kvh, hd] over the q|k|v heads of a layer.

    ``x * cos + x[..., rotation] * sin`` is RoPE on the q and k heads (``rotate_half``'s
    sign is in ``sin``), scales q by the attention scale, and leaves the v heads as they are.
    """
    half = head_dim // 2
    cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    scale = [head_dim ** -0.5 if scale is None else scale] * heads + [1.0] * kv_heads + [0.0] * kv_heads
    per_head = torch.tensor(scale, dtype=cos.dtype, device=cos.device)[:, None]
    keep_v = torch.tensor([0.0] * (heads + kv_heads) + [1.0] * kv_heads, dtype=cos.dtype, device=cos.device)[:, None]
    return cos * per_head + keep_v, sin * per_head


class GraphLayer(nn.Module):
    """A decoder layer as the graph runs it: the arithmetic of ``DecoderLayer.forward`` with
    its own weights, in about half the nodes, because ONNX Runtime pays per node and per copy.

    Activations carry a leading axis of 1, ``[1, B, T, ...]``, so that the layers' new K/V
    concatenate into the ``[layers, B, T, kvh, hd]`` outputs without a node a layer. RoPE,
    the attention scale and the q/k/v split take one pass over the heads of the fused
    projection (:func:`rope_tables`). Attention runs per K/V head: the query heads that share
    one are rows ``[1, B, kvh, T*groups, hd]`` against its past ``[1, B, kvh, W*bs, hd]``,
    which the gather reads head-major (:func:`past_rows`), so the past is never transposed
    nor concatenated; the new tokens' rows are written over their own (not yet filled)
    slots of the table (:class:`_PutRows`), under one mask for every head
    (:func:`grouped_mask`). Gemma's per-head q/k norms run before RoPE, its sandwich norms
    and activation as in ``DecoderLayer.forward``.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        half = layer.cfg.head_dim // 2
        self.rotation = list(range(half, 2 * half)) + list(range(half))

    def forward(self, x, cos, sin, past_k, past_v, mask, index):
        """x [1,B,T,H]; cos/sin from :func:`rope_tables`; past_k/v [1,B,kvh,W*bs,hd]; mask from
        :func:`grouped_mask`; index from :func:`new_rows`. Returns (x, k, v), k/v [1,B,T,kvh,hd]."""
        layer, cfg = self.layer, self.layer.cfg
        heads = reshape_tail(_linear(layer.input_norm(x), layer.qkv_t, layer.qkv_bias), 3,
                             cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            heads = qk_normed(heads, layer)
        heads = heads * cos + heads[..., torch.tensor(self.rotation)] * sin
        q, k, v = heads.split((cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads), dim=3)
        kvh, hd = cfg.num_kv_heads, cfg.head_dim
        # [1,B,T,heads,hd] -> [1,B,kvh,T*groups,hd]: each K/V head with the query heads that share it
        q = reshape_tail(reshape_tail(q, 3, kvh, -1, hd).permute(0, 1, 3, 2, 4, 5), 3, -1, hd)
        keys = _PutRows.apply(past_k, index, k.transpose(2, 3))
        values = _PutRows.apply(past_v, index, v.transpose(2, 3))
        probs = torch.softmax(q @ keys.transpose(3, 4) + mask, dim=-1)
        attn = reshape_tail(reshape_tail(probs @ values, 3, -1, cfg.num_heads // kvh, hd).permute(0, 1, 3, 2, 4, 5),
                            3, cfg.q_size)
        x = x + _normed(layer.attn_out_norm, _linear(attn, layer.o_t, layer.o_bias))
        gate_up = _linear(layer.post_attention_norm(x), layer.gate_up_t, layer.gate_up_bias)
        gate, up = gate_up[..., :cfg.intermediate_size], gate_up[..., cfg.intermediate_size:]
        x = x + _normed(layer.mlp_out_norm, _linear(layer.act(gate) * up, layer.down_t, layer.down_bias))
        return x, k, v


def qk_normed(heads: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """The q|k|v heads ``[..., heads + 2*kvh, hd]`` of a layer with Qwen3's per-head q and k norms applied."""
    cfg = layer.cfg
    q, k, v = heads.split((cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads), dim=-2)
    return torch.cat((layer.q_norm(q), layer.k_norm(k), v), dim=-2)


class DecoderGraph(nn.Module):
    """The decoder engine step with value-independent shapes, over :class:`GraphLayer` views
    of the decoder's layers, then the decoder's own final norm and head."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder
        self.layers = nn.ModuleList(GraphLayer(layer) for layer in decoder.layers)

    def forward(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        decoder, cfg = self.decoder, self.decoder.cfg
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tokens = inputs_embeds.shape[1]
        masking = (block_tables, context_lens, k_pool.shape[2], tokens, heads, kv_heads, image_groups)
        mask = grouped_mask(*masking)
        index = new_rows(context_lens, tokens, kv_heads)
        cos_sin = rope_tables(*decoder.rope(position_ids, inputs_embeds.dtype), heads, kv_heads, hd, cfg.attn_scale)
        local = (grouped_mask(*masking, window=cfg.sliding_window),
                 rope_tables(*decoder.rope(position_ids, inputs_embeds.dtype, local=True), heads, kv_heads, hd,
                             cfg.attn_scale)) if cfg.has_sliding_layers else None
        rows = past_rows(block_tables, k_pool.shape[1], k_pool.shape[2], kv_heads, cfg.num_layers)
        flat_k, flat_v = k_pool.reshape(-1, hd), v_pool.reshape(-1, hd)  # views: the pools are not copied
        x, additions = split_visual_additions(inputs_embeds, cfg)
        x, new_k, new_v = x[None], [], []
        for i, (layer, past) in enumerate(zip(self.layers, rows)):
            layer_mask, (cos, sin) = local if cfg.is_sliding(i) else (mask, cos_sin)
            x, k, v = layer(x, cos, sin, flat_k[past], flat_v[past], layer_mask, index)
            if additions is not None and i < cfg.deepstack_layers:
                x = x + additions[None, :, :, i]
            new_k.append(k)
            new_v.append(v)
        logits = decoder.norm(x[0, :, -1]) @ decoder.lm_head_t
        return logits, torch.cat(new_k), torch.cat(new_v)


class Gemma4DecoderGraph(nn.Module):
    """Gemma 4's decoder engine step with value-independent shapes: ``Gemma4Decoder.forward``
    over every slot of the table (masked past each row's context, as the CUDA graphs' static
    steps read it), with :func:`grouped_attention`."""

    def __init__(self, decoder: Gemma4Decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        decoder, tokens = self.decoder, inputs_embeds.shape[1]
        slots, mask = whole_block_slots_and_mask(block_tables, context_lens, k_pool.shape[2], tokens)
        mask, window = decoder.layer_masks(mask, context_lens, slots.shape[1], tokens, image_groups)
        return decoder.run_layers(inputs_embeds, position_ids, pool_reader(k_pool, v_pool, slots), mask,
                                  window_mask=window, attend=grouped_attention)


def pool_reader(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor):
    """``read_past`` of ``Decoder.run_layers``: layer ``i``'s K/V ``[B, S, kvh, hd]`` at ``slots``
    [B, S], one gather of the pool viewed as ``[layers*blocks*bs, kvh, hd]`` (not ``pool[i]``,
    which the graph would copy whole first)."""
    per_layer = k_pool.shape[1] * k_pool.shape[2]
    flat_k, flat_v = k_pool.flatten(0, 2), v_pool.flatten(0, 2)
    return lambda i: (flat_k[slots + i * per_layer], flat_v[slots + i * per_layer])


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      groups: int, scale: float | None = None) -> torch.Tensor:
    """:func:`~edgeinfer.models.decoder.attention` as products the exporter writes (its
    ``scaled_dot_product_attention`` takes no grouped K/V heads): q [B,heads,T,hd] as
    [B,kvh,groups,T,hd] against keys/values [B,kvh,S,hd], under the bool ``mask`` [B,1,T,S]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.unflatten(1, (-1, groups)) @ keys[:, :, None].transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values[:, :, None]).flatten(1, 2)


def decoder_graph(decoder: Decoder) -> nn.Module:
    """The module exported as ``decoder``'s graph: Gemma 4's own, else :class:`DecoderGraph`."""
    return Gemma4DecoderGraph(decoder) if isinstance(decoder, Gemma4Decoder) else DecoderGraph(decoder)


def decoder_axes(mrope: bool, image_groups: bool = False) -> dict[str, dict[int, str]]:
    positions = {1: "batch", 2: "tokens"} if mrope else {0: "batch", 1: "tokens"}
    pool = {1: "blocks", 2: "block_size"}
    groups = {IMAGE_GROUPS: {0: "batch", 1: "tokens"}} if image_groups else {}
    return groups | {"inputs_embeds": {0: "batch", 1: "tokens"}, "position_ids": positions, "k_pool": pool, "v_pool": pool,
            "block_tables": {0: "batch", 1: "table"}, "context_lens": {0: "batch"}, "logits": {0: "batch"},
            "new_k": {1: "batch", 2: "tokens"}, "new_v": {1: "batch", 2: "tokens"}}


def decoder_example(decoder: Decoder, *, batch: int, tokens: int, block_size: int, context: list[int],
                    num_blocks: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of one step: token embeddings, positions after each context, a random pool.

    A decoder with deepstack layers takes its rows' full width, with random additions: the
    graph is exported for (and checked on) rows that carry them."""
    cfg = decoder.cfg
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen)
    with torch.no_grad():
        embeds = decoder.embed_tokens(ids).float()
    if cfg.deepstack_layers:
        additions = torch.randn(batch, tokens, cfg.embed_width - cfg.hidden_size, generator=gen)
        embeds = torch.cat((embeds, additions), dim=-1)
    embeds = embeds.contiguous()
    lens = torch.tensor(context, dtype=torch.int64)
    positions = lens[:, None] + torch.arange(tokens)
    if cfg.mrope_section is not None:
        positions = positions.expand(3, batch, tokens)
    width = max(1, -(-(max(context) + tokens) // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    shape = (cfg.kv_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    example = {"inputs_embeds": embeds, "position_ids": positions.contiguous(),
               "k_pool": torch.randn(shape, generator=gen), "v_pool": torch.randn(shape, generator=gen),
               "block_tables": tables.contiguous(), "context_lens": lens}
    if cfg.bidirectional_images:  # new tokens 1.. of each row form one image run (all text with one token)
        example[IMAGE_GROUPS] = torch.where(torch.arange(tokens) > 0, 0, -1).expand(batch, tokens).contiguous()
    return example


# --------------------------------------------------------------------------- the vision graphs


def vision_graph_for(model) -> VisionGraph | None:
    """The vision graph a loaded model's family declares; None keeps its vision engine on torch."""
    return model.adapter.vision_graph(model.vision)
