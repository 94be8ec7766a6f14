"""Gemma 4: Gemma 3's decoder grown per layer, a patch-sequence vision tower with pooling.

What Gemma 4's text model adds over Gemma 3, each held here (transformers 5.24's
``modeling_gemma4.py`` is the reference arithmetic):

- **Per-layer shapes.** Global (full-attention) layers have their own head size
  (``global_head_dim``) and, with ``attention_k_eq_v``, their own K/V head count and no value
  projection (values are the raw key projection). A pool layer holds the narrowest owning
  layer's K/V heads x head size; a wider layer's values lie across several pool layers side
  by side (:meth:`Gemma4Shape.pool_spans`), so the pool holds exactly what the layers own.
- **KV sharing.** The last ``num_kv_shared_layers`` layers compute no K/V: each attends to
  the K/V of the last earlier layer of its own type, and keeps no pool layers. Those layers
  may have double-wide MLPs.
- **Per-layer input embeddings (PLE).** A second table gives every token a small vector per
  layer; with a projection of the layer input it gates a residual added after each layer's
  MLP. The lookup needs the token id inside the decoder step, so every embedding row carries
  its id after the hidden values, as three base-256 digits (exact in bf16, fp16 and fp32);
  image rows carry the pad id, as transformers looks images up.
- **Norms and scales.** RMSNorm scales by ``w`` (not ``1 + w``); values are RMS-normed with
  no weight; the softmax scale is 1 (q and k are normed); each layer's output is multiplied
  by a stored ``layer_scalar``; logits are soft-capped (``final_logit_softcapping``).
- **RoPE.** Sliding layers rotate every pair; global layers use "proportional" RoPE over
  their wider heads, rotating only ``partial_rotary_factor`` of the pairs.
- **Images.** Causal by default; with ``use_bidirectional_attention="vision"`` an image's
  tokens see each other on sliding layers only (global layers stay causal).

The vision tower is transformers' own ``Gemma4VisionModel`` (a patch sequence with 2-D
position tables and 2-D RoPE, pooled by ``pooling_kernel_size``) and its embedder; an
image becomes ``<|image>`` + one ``<|image|>`` per pooled token + ``<image|>``.

Not run (refused at load, with the reason): mixture-of-experts blocks
(``enable_moe_block``), bidirectional attention over all tokens
(``use_bidirectional_attention="all"``). Audio and video inputs are not taken; an audio
tower's weights are skipped.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.errors import ModelLoadError
from edgeinfer.models.base import (
    FamilyAdapter,
    ImageInputs,
    PromptLayout,
    load_module_state,
)
from edgeinfer.models.decoder import (
    ACTIVATIONS,
    Decoder,
    DecoderConfig,
    attention,
    layer_masks,
    past_reader,
    past_slots_and_mask,
    rotate_half,
)
from edgeinfer.models.export import VisionGraph
from edgeinfer.models.gemma3 import image_runs
from edgeinfer.quant.weights import QuantizedWeight

SLIDING = "sliding_attention"
FULL = "full_attention"
ID_DIGITS = 3  # a token id rides in its embedding row as this many base-256 digits
ID_BASE = 256

_RENAMES = (
    (r"^model\.vision_tower\.", "vision.tower."),
    (r"^model\.embed_vision\.", "vision.embedder."),
    (r"^model\.language_model\.", "text."),
    (r"^model\.(audio_tower|embed_audio)\..*", ""),  # audio is not taken: its weights are skipped
    (r"^lm_head\.", "text.lm_head."),
)


def unsupported_features(text_config) -> list[str]:
    """What a Gemma 4 text config uses that this runtime does not run."""
    missing = []
    if getattr(text_config, "enable_moe_block", False):
        missing.append("mixture-of-experts blocks (enable_moe_block)")
    if getattr(text_config, "use_bidirectional_attention", None) == "all":
        missing.append("bidirectional attention over all tokens (use_bidirectional_attention='all')")
    unknown = set(text_config.layer_types) - {SLIDING, FULL}
    if unknown:
        missing.append(f"layer types {sorted(unknown)}")
    if getattr(text_config, "attention_bias", False):
        missing.append("attention biases")
    return missing


@dataclass(frozen=True, slots=True)
class LayerShape:
    """One Gemma 4 layer's own sizes, beside the shared :class:`DecoderConfig`."""

    head_dim: int
    kv_heads: int
    intermediate_size: int
    k_eq_v: bool  # values are the raw key projection (no v_proj)
    kv_source: int  # the layer whose K/V it attends to: itself, or an earlier one of its type
    stores_kv: bool  # a later layer attends to its K/V


@dataclass(frozen=True, slots=True)
class Gemma4Shape:
    layers: tuple[LayerShape, ...]
    per_layer_input_size: int  # hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_vocab: int
    final_softcap: float | None
    bidirectional_images: bool  # on sliding layers only
    # Image, video and audio placeholder ids embed as the pad token (as transformers embeds them,
    # generated ones included).
    placeholder_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    @classmethod
    def from_hf(cls, text, placeholder_ids: tuple[int, ...] = ()) -> Gemma4Shape:
        types = list(text.layer_types)
        sources = kv_sources(types, int(text.num_kv_shared_layers or 0))
        layers = []
        for i, t in enumerate(types):
            own = text.per_layer_config[i]
            shared = sources[i] != i
            wide = bool(text.use_double_wide_mlp) and shared
            layers.append(LayerShape(
                head_dim=own.head_dim, kv_heads=own.num_key_value_heads,
                intermediate_size=text.intermediate_size * (2 if wide else 1),
                k_eq_v=bool(text.attention_k_eq_v) and t == FULL,
                kv_source=sources[i], stores_kv=i in sources[i + 1:]))
        return cls(tuple(layers), int(text.hidden_size_per_layer_input or 0), int(text.vocab_size_per_layer_input),
                   text.final_logit_softcapping, text.use_bidirectional_attention == "vision", placeholder_ids,
                   int(text.pad_token_id or 0))

    def owns_kv(self, i: int) -> bool:
        return self.layers[i].kv_source == i

    @property
    def kv_owners(self) -> tuple[int, ...]:
        """The layers that keep K/V: the first ones (the sharing layers are the last, see
        :func:`kv_sources`), so layer ``i`` of these is the pool's layer ``i``."""
        owners = tuple(i for i in range(len(self.layers)) if self.owns_kv(i))
        if owners != tuple(range(len(owners))):
            raise ValueError(f"the layers keeping K/V are {list(owners)}; the pool takes them only before the "
                             "layers that share K/V")
        return owners

    @property
    def pool_slot(self) -> int:
        """Values per token of one pool layer (K or V): the greatest common divisor of the owning
        layers' K/V heads x head size, so that every owner fills whole pool layers."""
        return math.gcd(*(self.layers[i].kv_heads * self.layers[i].head_dim for i in self.kv_owners))

    def pool_spans(self) -> list[range]:
        """The pool layers each owning layer's K/V take, in order (a global layer's wider heads
        take several)."""
        spans, start, slot = [], 0, self.pool_slot
        for i in self.kv_owners:
            width = self.layers[i].kv_heads * self.layers[i].head_dim // slot
            spans.append(range(start, start + width))
            start += width
        return spans

    def kv_values_per_token(self) -> tuple[int, int]:
        """K values per token (V: as many) that the layers owning K/V need, and that the pool holds."""
        owned = sum(self.layers[i].kv_heads * self.layers[i].head_dim for i in self.kv_owners)
        return owned, self.pool_slot * sum(len(span) for span in self.pool_spans())


def kv_sources(layer_types: list[str], shared_layers: int) -> list[int]:
    """The layer whose K/V each layer attends to: itself, or for the last ``shared_layers``
    the last earlier layer of its own type that has K/V (transformers' ``kv_sharing_modes``,
    computed here: transformers 5.17's config does not have it)."""
    first_shared = len(layer_types) - shared_layers
    sources = []
    for i, t in enumerate(layer_types):
        if i < first_shared:
            sources.append(i)
            continue
        earlier = [j for j in range(first_shared) if layer_types[j] == t]
        if not earlier:
            raise ValueError(f"layer {i} ({t}) shares K/V, but no earlier layer of its type has any")
        sources.append(earlier[-1])
    return sources


class Gemma4RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: ``x * (mean(x^2) + eps) ** -0.5`` in float32, times ``w`` where it has one."""

    def __init__(self, size: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class Gemma4Layer(nn.Module):
    """A Gemma 4 decoder layer. The matrices are stored transposed and fused as in
    :class:`~edgeinfer.models.decoder.DecoderLayer` (``qkv_t``, ``o_t``, ``gate_up_t``, ``down_t``)."""

    def __init__(self, cfg: DecoderConfig, shape: LayerShape, owns_kv: bool, per_layer_input_size: int) -> None:
        super().__init__()
        self.cfg, self.shape, self.owns_kv = cfg, shape, owns_kv
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_size = cfg.num_heads * shape.head_dim
        self.kv_size = shape.kv_heads * shape.head_dim
        kv_width = 0 if not owns_kv else self.kv_size * (1 if shape.k_eq_v else 2)
        self.input_norm = Gemma4RMSNorm(h, eps)
        self.attn_out_norm = Gemma4RMSNorm(h, eps)
        self.post_attention_norm = Gemma4RMSNorm(h, eps)  # the norm before the MLP
        self.mlp_out_norm = Gemma4RMSNorm(h, eps)
        self.q_norm = Gemma4RMSNorm(shape.head_dim, eps)
        self.k_norm = Gemma4RMSNorm(shape.head_dim, eps) if owns_kv else None
        self.v_norm = Gemma4RMSNorm(shape.head_dim, eps, with_scale=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.qkv_t = nn.Parameter(torch.empty(h, self.q_size + kv_width))
        self.o_t = nn.Parameter(torch.empty(self.q_size, h))
        self.gate_up_t = nn.Parameter(torch.empty(h, 2 * shape.intermediate_size))
        self.down_t = nn.Parameter(torch.empty(shape.intermediate_size, h))
        self.per_layer_input_size = per_layer_input_size
        if per_layer_input_size:
            self.ple_gate_t = nn.Parameter(torch.empty(h, per_layer_input_size))
            self.ple_proj_t = nn.Parameter(torch.empty(per_layer_input_size, h))
            self.ple_norm = Gemma4RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def new_kv(self, normed: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """K [B,kvh,T,hd] (normed, rotated) and V [B,T,kvh,hd] (normed) of the new tokens."""
        s = self.shape
        proj = normed @ self.qkv_t[:, self.q_size:]
        k = proj[..., :self.kv_size].unflatten(-1, (s.kv_heads, s.head_dim))
        v = k if s.k_eq_v else proj[..., self.kv_size:].unflatten(-1, (s.kv_heads, s.head_dim))
        k = self.k_norm(k).transpose(1, 2)
        return k * cos + rotate_half(k) * sin, self.v_norm(v)

    def forward(self, x, cos, sin, past, shared, mask, per_layer_input, attend=attention):
        """x [B,T,H]. A layer that owns K/V reads ``past`` (k, v) ``[B,S,kvh,hd]`` (the pool's
        pool layers joined into its sizes); a sharing layer attends to ``shared`` (keys, values)
        ``[B,kvh,S+T,hd]``, its source layer's. Returns (x, keys, values, new_k, new_v), the new
        K/V ``[B,T,kvh,hd]`` (None for a sharing layer). ``attend`` has the signature of
        :func:`~edgeinfer.models.decoder.attention` (the ONNX graph passes one it can export)."""
        cfg, s = self.cfg, self.shape
        normed = self.input_norm(x)
        q = (normed @ self.qkv_t[:, :self.q_size]).unflatten(-1, (cfg.num_heads, s.head_dim))
        q = self.q_norm(q).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        new_k = new_v = None
        if shared is None:
            k, new_v = self.new_kv(normed, cos, sin)
            new_k = k.transpose(1, 2)
            keys = torch.cat((past[0], new_k), dim=1).transpose(1, 2)
            values = torch.cat((past[1], new_v), dim=1).transpose(1, 2)
        else:
            keys, values = shared
        attn = attend(q, keys, values, mask, cfg.num_heads // s.kv_heads, cfg.attn_scale)
        x = x + self.attn_out_norm(attn.transpose(1, 2).flatten(2) @ self.o_t)
        gate_up = self.post_attention_norm(x) @ self.gate_up_t
        gate, up = gate_up[..., :s.intermediate_size], gate_up[..., s.intermediate_size:]
        x = x + self.mlp_out_norm((self.act(gate) * up) @ self.down_t)
        if self.per_layer_input_size:
            gated = self.act(x @ self.ple_gate_t) * per_layer_input
            x = x + self.ple_norm(gated @ self.ple_proj_t)
        return x * self.layer_scalar, keys, values, new_k, new_v


def id_digits(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[...] token ids -> [..., ID_DIGITS] base-256 digits, most significant first."""
    powers = ID_BASE ** torch.arange(ID_DIGITS - 1, -1, -1, device=ids.device)
    return (ids[..., None] // powers % ID_BASE).to(dtype)


def ids_from_digits(digits: torch.Tensor) -> torch.Tensor:
    powers = ID_BASE ** torch.arange(ID_DIGITS - 1, -1, -1, device=digits.device)
    return (digits.round().long() * powers).sum(-1)


class Gemma4Decoder(Decoder):
    """The decoder engine step for Gemma 4 text models (see the module docstring).

    Embedding rows are ``hidden_size + ID_DIGITS`` wide: the embedding, then the token id
    the per-layer inputs are looked up with."""

    def __init__(self, cfg: DecoderConfig, shape: Gemma4Shape, inv_freq: torch.Tensor, attention_scaling: float,
                 local_rope: tuple[torch.Tensor, float]) -> None:
        super().__init__(cfg, inv_freq, attention_scaling, local_rope)
        self.shape = shape
        # Fixed by the shape; kept rather than derived in every step.
        self.pool_slot, self.pool_spans = shape.pool_slot, shape.pool_spans()
        # A buffer, not a tensor made per call: a CUDA graph's capture allows no host-to-device copy.
        self.register_buffer("placeholder_ids", torch.tensor(shape.placeholder_ids, dtype=torch.long), persistent=False)
        ple = shape.per_layer_input_size
        self.layers = nn.ModuleList(Gemma4Layer(cfg, layer, shape.owns_kv(i), ple)
                                    for i, layer in enumerate(shape.layers))
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if ple:
            self.ple_embed = nn.Parameter(torch.empty(shape.per_layer_vocab, cfg.num_layers * ple))
            self.ple_model_proj_t = nn.Parameter(torch.empty(cfg.hidden_size, cfg.num_layers * ple))
            self.ple_proj_norm = Gemma4RMSNorm(ple, cfg.rms_norm_eps)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.where(torch.isin(ids, self.placeholder_ids), self.shape.pad_token_id, ids)
        embeds = super().embed_tokens(ids)
        return torch.cat((embeds, id_digits(ids, embeds.dtype)), dim=-1)

    def per_layer_inputs(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[B,T,layers,ple]: the token's own vector per layer plus a projection of its embedding
        (transformers' ``get_per_layer_inputs`` + ``project_per_layer_inputs``)."""
        cfg, ple = self.cfg, self.shape.per_layer_input_size
        table = self.ple_embed
        own = F.embedding(ids, table) * torch.tensor(ple ** 0.5, dtype=table.dtype)
        projected = (x @ self.ple_model_proj_t) * (cfg.hidden_size ** -0.5)
        projected = self.ple_proj_norm(projected.unflatten(-1, (cfg.num_layers, ple)))
        return (projected + own.unflatten(-1, (cfg.num_layers, ple))) * (2.0 ** -0.5)

    def forward(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        """The decoder engine step (``Decoder.forward``). Global layers stay causal; with
        ``image_groups``, an image's tokens see each other on sliding layers."""
        tokens = inputs_embeds.shape[1]
        slots, mask = past_slots_and_mask(block_tables, context_lens, k_pool.shape[2], tokens)
        mask, window = self.layer_masks(mask, context_lens, slots.shape[1], tokens, image_groups)
        return self.run_layers(inputs_embeds, position_ids, past_reader(k_pool, v_pool, slots), mask,
                               window_mask=window)

    def layer_masks(self, mask, context_lens, past: int, tokens: int, image_groups=None):
        """(global layers' mask, sliding layers' mask) from the causal ``mask`` over ``past`` +
        ``tokens`` keys (:func:`~edgeinfer.models.decoder.layer_masks`); ``image_groups`` widen the
        sliding layers' mask only, and only where the checkpoint's images attend both ways."""
        mask, window = layer_masks(self.cfg, mask, context_lens, past, tokens)
        if image_groups is not None and self.shape.bidirectional_images:
            _, window = layer_masks(self.cfg, mask, context_lens, past, tokens, image_groups)
        return mask, window

    def run_layers(self, inputs_embeds, position_ids, read_past, mask, layer_fn=None, last=None, window_mask=None,
                   attend=attention):
        """``Decoder.run_layers`` for Gemma 4 layers. ``layer_fn`` (a compiled
        ``DecoderLayer.forward``) does not fit them and is not used: the layers run as they are.
        ``attend`` replaces the layers' :func:`~edgeinfer.models.decoder.attention`."""
        cfg, shape = self.cfg, self.shape
        dtype = inputs_embeds.dtype
        rope = self.rope(position_ids, dtype)
        local_rope = self.rope(position_ids, dtype, local=True)
        x, ids = inputs_embeds[..., :cfg.hidden_size], ids_from_digits(inputs_embeds[..., cfg.hidden_size:])
        per_layer = self.per_layer_inputs(x, ids) if shape.per_layer_input_size else None
        new_k, new_v, kv = [], [], {}
        for i, layer in enumerate(self.layers):
            sliding = cfg.is_sliding(i)
            cos, sin = local_rope if sliding else rope
            s = layer.shape
            past = None
            if layer.owns_kv:  # its pool layers side by side are its [kv_heads, head_dim] values
                parts = [read_past(j) for j in self.pool_spans[i]]
                past = tuple(torch.cat([part[n] for part in parts], dim=-1).unflatten(-1, (s.kv_heads, s.head_dim))
                             .flatten(-3, -2) for n in (0, 1))
            x, keys, values, k, v = layer(x, cos, sin, past, kv.get(s.kv_source), window_mask if sliding else mask,
                                          None if per_layer is None else per_layer[:, :, i], attend)
            if s.stores_kv:
                kv[i] = (keys, values)
            if layer.owns_kv:
                new_k += self._to_pool(k)
                new_v += self._to_pool(v)
        x = x[:, -1] if last is None else x.gather(1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))[:, 0]
        return self.logits(x), torch.stack(new_k), torch.stack(new_v)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head, soft-capped where the config caps the logits."""
        logits = self.norm(x) @ self.lm_head_t
        cap = self.shape.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _to_pool(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """[B,T,kvh,hd] of one layer -> its pool layers' [B,T,1,slot] values."""
        return [part.unsqueeze(-2) for part in kv.flatten(-2).split(self.pool_slot, dim=-1)]


def load_gemma4_weights(decoder: Gemma4Decoder, tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``decoder`` from transformers' Gemma 4 text-model tensors; missing or unexpected names are
    errors. A quantized checkpoint's low-bit products are dequantized: the packed kernels serve
    the shared decoder's layers only."""
    dtype = decoder.lm_head_t.dtype
    remaining = {n: t.dequantize(dtype) if isinstance(t, QuantizedWeight) else t for n, t in tensors.items()}

    def take(name: str) -> torch.Tensor:
        try:
            return remaining.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint lacks decoder weight {name!r}") from None

    def assign(param: torch.Tensor, value: torch.Tensor) -> None:
        if param.shape != value.shape:
            raise ValueError(f"shape {tuple(value.shape)} does not fit {tuple(param.shape)}")
        param.data = value.to(param.dtype).contiguous()

    with torch.no_grad():
        for i, layer in enumerate(decoder.layers):
            p = f"layers.{i}."
            names = ["q"] + (["k"] + ([] if layer.shape.k_eq_v else ["v"]) if layer.owns_kv else [])
            assign(layer.qkv_t, torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in names]).t())
            assign(layer.o_t, take(p + "self_attn.o_proj.weight").t())
            assign(layer.gate_up_t, torch.cat((take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))).t())
            assign(layer.down_t, take(p + "mlp.down_proj.weight").t())
            norms = {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                     "post_attention_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm",
                     "q_norm": "self_attn.q_norm"} | ({"k_norm": "self_attn.k_norm"} if layer.owns_kv else {})
            for ours, theirs in norms.items():
                assign(getattr(layer, ours).weight, take(p + theirs + ".weight"))
            if layer.per_layer_input_size:
                assign(layer.ple_gate_t, take(p + "per_layer_input_gate.weight").t())
                assign(layer.ple_proj_t, take(p + "per_layer_projection.weight").t())
                assign(layer.ple_norm.weight, take(p + "post_per_layer_input_norm.weight"))
            layer.layer_scalar = take(p + "layer_scalar").to(layer.layer_scalar.dtype).reshape(1)
            for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight"):
                if not layer.owns_kv:  # older saves keep a shared layer's unused projections
                    remaining.pop(p + name, None)
        assign(decoder.norm.weight, take("norm.weight"))
        if decoder.shape.per_layer_input_size:
            assign(decoder.ple_embed, take("embed_tokens_per_layer.weight"))
            assign(decoder.ple_model_proj_t, take("per_layer_model_projection.weight").t())
            assign(decoder.ple_proj_norm.weight, take("per_layer_projection_norm.weight"))
        embed = take("embed_tokens.weight")
        head = remaining.pop("lm_head.weight", None)
        if decoder.cfg.tie_word_embeddings:
            assign(decoder.lm_head_t, embed.t())
        else:
            if head is None:
                raise KeyError("checkpoint lacks 'lm_head.weight' and does not tie embeddings")
            assign(decoder.embed, embed)
            assign(decoder.lm_head_t, head.t())
    if remaining:
        raise KeyError(f"unexpected decoder weights: {sorted(remaining)[:8]}")


class Gemma4VisionEncoder(nn.Module):
    """One image's patches ``[1, max_patches, 3 * p * p]`` and their (x, y) positions
    ``[1, max_patches, 2]`` (-1: padding) -> ``[tokens, text_hidden + ID_DIGITS]`` rows whose
    id digits name the pad token, as transformers looks image positions up in the per-layer table."""

    def __init__(self, tower: nn.Module, embedder: nn.Module, pad_token_id: int) -> None:
        super().__init__()
        self.tower = tower
        self.embedder = embedder
        self.pad_token_id = pad_token_id

    def forward(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.embedder.embedding_projection.weight.dtype
        features = self.tower(pixel_values=pixel_values.to(dtype), pixel_position_ids=image_position_ids)
        embeds = self.embedder(features.last_hidden_state)
        pad = torch.full(embeds.shape[:-1], self.pad_token_id, device=embeds.device)
        return torch.cat((embeds, id_digits(pad, embeds.dtype)), dim=-1)


class Gemma4Adapter(FamilyAdapter):
    architectures = ("Gemma4ForConditionalGeneration",)
    weight_renames = _RENAMES

    def __init__(self, checkpoint) -> None:
        super().__init__(checkpoint)
        if getattr(self.config, "model_type", None) != "gemma4":
            raise ModelLoadError(f"{checkpoint.path}: config.json names Gemma4ForConditionalGeneration but its "
                                 f"model_type is {getattr(self.config, 'model_type', None)!r}, not 'gemma4'")
        missing = unsupported_features(self.text_config)
        if missing:
            raise ModelLoadError(f"{checkpoint.path}: this Gemma 4 checkpoint uses what edgeinfer does not run: "
                                 f"{'; '.join(missing)}")

    @property
    def image_marker(self) -> str:
        return self.tokenizer.image_token

    @property
    def image_token_id(self) -> int:
        return int(self.config.image_token_id)

    @property
    def vision_hidden(self) -> int:
        return int(self.config.vision_config.hidden_size)

    @property
    def patches_per_token(self) -> int:
        return int(self.config.vision_config.pooling_kernel_size) ** 2

    # --- text side -----------------------------------------------------------------
    def shape(self) -> Gemma4Shape:
        placeholders = (self.config.image_token_id, self.config.video_token_id, self.config.audio_token_id)
        return Gemma4Shape.from_hf(self.text_config, tuple(int(i) for i in placeholders if i is not None))

    def decoder_config(self) -> DecoderConfig:
        """The shared fields; a KV pool layer holds one K/V head of the narrowest owner's width."""
        text, shape = self.text_config, self.shape()
        return DecoderConfig(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers, num_heads=text.num_attention_heads,
            num_kv_heads=1, head_dim=shape.pool_slot,
            rms_norm_eps=text.rms_norm_eps, qkv_bias=False, o_bias=False, mlp_bias=False,
            tie_word_embeddings=bool(getattr(self.config, "tie_word_embeddings", True)),
            sandwich_norms=True, qk_norm=True, hidden_act=text.hidden_activation,
            embed_scale=float(text.hidden_size) ** 0.5, attn_scale=1.0, sliding_window=text.sliding_window,
            sliding_layers=tuple(t == SLIDING for t in text.layer_types),
            bidirectional_images=shape.bidirectional_images, per_layer_shapes=True,
            pool_layers=sum(len(span) for span in shape.pool_spans()),
        )

    def rope(self, layer_type: str) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and scaling of one layer type, at that type's head size."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        text = self.text_config
        rope = text.rope_parameters[layer_type]
        layer = text.per_layer_config[layer_type]
        if rope["rope_type"] == "default":
            dim = layer.head_dim
            return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        return ROPE_INIT_FUNCTIONS[rope["rope_type"]](layer, "cpu", layer_type=layer_type)

    def build_decoder(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Gemma4Decoder:
        global_rope, local_rope = self.rope(FULL), self.rope(SLIDING)
        with torch.device("meta"):
            decoder = Gemma4Decoder(self.decoder_config(), self.shape(), global_rope[0].to("meta"), global_rope[1],
                                    (local_rope[0].to("meta"), local_rope[1]))
        decoder = decoder.to_empty(device="cpu").to(dtype)
        decoder.inv_freq, decoder.local_inv_freq = global_rope[0].float(), local_rope[0].float()
        decoder.placeholder_ids = torch.tensor(decoder.shape.placeholder_ids, dtype=torch.long)
        load_gemma4_weights(decoder, tensors)
        return decoder.eval()

    def stop_token_ids(self) -> tuple[int, ...]:
        ids = list(super().stop_token_ids())
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<turn|>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id and end_of_turn not in ids:
            ids.append(end_of_turn)  # the template closes every turn with it
        return tuple(ids)

    def layout(self, token_ids: list[int], images: list[ImageInputs]) -> PromptLayout:
        n = len(token_ids)
        groups = image_runs(token_ids, self.image_token_id) if self.shape().bidirectional_images else None
        return PromptLayout(token_ids, torch.arange(n), n, self.image_token_id, attend_groups=groups)

    # --- vision side ---------------------------------------------------------------
    def build_vision(self, tensors, dtype):
        from transformers import AutoModel
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        with torch.device("meta"):
            tower = AutoModel.from_config(self.config.vision_config)
            embedder = Gemma4MultimodalEmbedder(self.config.vision_config, self.text_config)
        module = load_module_state(Gemma4VisionEncoder(tower, embedder, int(self.text_config.pad_token_id)),
                                   tensors, dtype)
        rotary = module.tower.encoder.rotary_emb
        inv_freq, _ = rotary.compute_axial_rope_parameters(self.config.vision_config)
        rotary.inv_freq, rotary.original_inv_freq = inv_freq, inv_freq.clone()
        left = [name for name, buf in module.named_buffers() if buf.is_meta]
        if left:
            raise ValueError(f"vision buffers {left[:4]} have no values after loading")
        return module.eval()

    def vision_graph(self, vision):
        return VisionGraph(vision, ("pixel_values", "image_position_ids"), "images")

    def process_image(self, image) -> ImageInputs:
        out = self.image_processor(images=[image], return_tensors="pt")
        tokens = int(out["num_soft_tokens_per_image"][0])
        tok = self.tokenizer
        return ImageInputs(tensors={"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]},
                           num_tokens=tokens, placeholder=f"{tok.boi_token}{tok.image_token * tokens}{tok.eoi_token}")

    def vision_patches(self, image: ImageInputs) -> int:
        return int(image.tensors["pixel_values"].shape[1])

    def image_limits(self):
        return {"max_side": None, "max_pixels": None, "min_side": None}
