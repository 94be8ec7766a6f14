"""Our compact decoder for the Llama / SmolLM2 / Qwen2 / Qwen3 family, reading a paged KV pool.

One implementation covers RMSNorm, RoPE and M-RoPE (Qwen2-VL's three position axes, in
sections, or Qwen3-VL's interleaved), grouped-query attention, SwiGLU, optional q/k/v
bias, Qwen3's per-head q/k RMSNorm, tied embeddings, and Qwen3-VL's deepstack: visual
features added to the hidden states of the first layers at the image positions.

Deepstack additions ride in the embedding rows: a decoder with ``deepstack_layers = D``
takes ``inputs_embeds`` of width ``(1 + D) * hidden`` (the token's embedding, then what
layers ``0..D-1`` add after them), or of width ``hidden`` where no token has additions
(decode steps, text-only prompts). So the engine contract, the prefix cache and the
vision cache carry them without a second code path.

Gemma 3's differences are separate fields, each off by default: RMSNorm scaling by
``1 + w``, norms around the attention and MLP outputs, GELU-tanh, scaled embeddings, its
attention scale, sliding-window layers with their own RoPE base between global ones, and
image tokens that attend to the rest of their image (the text stays causal).

Weights are stored transposed (``[in, out]``) and fused (q|k|v, gate|up): at batch 1 a
decode step is a chain of matrix-vector products, and on CPUs ``x @ W_t`` with a
row-major ``W_t`` streams memory about twice as fast as ``F.linear`` with ``W``.

The forward pass is the decoder engine contract of ``docs/architecture.md``: it reads
the past through the block table (a gather), returns logits of the last position and
the new K/V only; the runtime writes those into the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.quant.packed import PackedMatrix, pack_product, why_not_packable
from edgeinfer.quant.weights import QuantizedWeight


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL: t, h, w frequencies alternate instead of lying in sections
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    deepstack_layers: int = 0  # Qwen3-VL: layers after which the embedding rows' visual additions are added
    # Gemma 3 (see the module docstring); the defaults are the Llama/Qwen2 decoder.
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight); Gemma stores weight - 1
    sandwich_norms: bool = False  # attention and MLP outputs are normed before the residual adds
    hidden_act: str = "silu"
    embed_scale: float = 1.0  # token embeddings (not image embeddings) are multiplied by this
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # a sliding layer's query sees the keys less than this many tokens back
    sliding_layers: tuple[bool, ...] = ()  # per layer: True attends within sliding_window (empty: none)
    bidirectional_images: bool = False  # the tokens of one image attend to each other in both directions
    # Gemma 4 (models/gemma4.py): layers differ in head size, K/V source and per-layer inputs,
    # which its own decoder class holds; num_kv_heads and head_dim are then a pool layer's (one
    # head of the narrowest owning layer's width).
    per_layer_shapes: bool = False
    # Layers of the KV pool (0: one per layer). Gemma 4's sharing layers keep none, and a wider
    # layer takes several (models/gemma4.py).
    pool_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} does not cover head_dim={self.head_dim}")
        if self.mrope_interleaved and self.mrope_section is None:
            raise ValueError("mrope_interleaved needs mrope_section")
        if not 0 <= self.deepstack_layers <= self.num_layers:
            raise ValueError(f"deepstack_layers={self.deepstack_layers} is not in [0, num_layers={self.num_layers}]")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported by the decoder; "
                             f"supported: {sorted(ACTIVATIONS)}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers names {len(self.sliding_layers)} layers, the decoder has {self.num_layers}")
        if any(self.sliding_layers) and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding layers need a positive sliding_window, got {self.sliding_window}")

    @property
    def embed_width(self) -> int:
        """Width of an embedding row that carries deepstack additions (``hidden_size`` without them)."""
        return (1 + self.deepstack_layers) * self.hidden_size

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.sliding_layers)

    def gemma_features(self) -> list[str]:
        """The Gemma fields this decoder uses (empty for the Llama/Qwen2/Qwen3 decoder): what a
        backend that implements only the latter must refuse."""
        changed = {
            "norm_offset": self.norm_offset != 0.0, "sandwich_norms": self.sandwich_norms,
            "hidden_act": self.hidden_act != "silu", "attn_scale": self.attn_scale is not None,
            "sliding_layers": self.has_sliding_layers,
            "bidirectional_images": self.bidirectional_images, "per_layer_shapes": self.per_layer_shapes,
        }
        return [name for name, used in changed.items() if used]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_layers(self) -> int:
        """Layers of the KV pool: those that keep K/V."""
        return self.pool_layers or self.num_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over the pool's layers, at 4 bytes per value (scale by dtype)."""
        return 2 * self.kv_layers * self.kv_size

    @classmethod
    def from_hf(cls, text_config, *, qkv_bias: bool, mrope: bool = False) -> "DecoderConfig":
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        rope = getattr(text_config, "rope_parameters", None) or {}
        section = tuple(rope.get("mrope_section", ())) if mrope else ()
        act = getattr(text_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported by the decoder (only 'silu')")
        return cls(
            vocab_size=text_config.vocab_size,
            hidden_size=text_config.hidden_size,
            intermediate_size=text_config.intermediate_size,
            num_layers=text_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=text_config.rms_norm_eps,
            qkv_bias=qkv_bias or bool(getattr(text_config, "attention_bias", False)),
            o_bias=bool(getattr(text_config, "attention_bias", False)),
            mlp_bias=bool(getattr(text_config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
            mrope_section=section or None,
        )


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rope_inv_freq(text_config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for any RoPE type transformers knows;
    ``layer_type`` picks one of per-layer-type parameters (Gemma 3: sliding / full attention)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(text_config, "rope_parameters", None) or {}
    if layer_type is not None:
        rope = rope[layer_type]
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        heads = text_config.num_attention_heads
        dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        base = rope["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic RoPE scaling is not supported: its frequencies change with length")
    if layer_type is not None:
        return ROPE_INIT_FUNCTIONS[rope_type](text_config, "cpu", layer_type=layer_type)
    return ROPE_INIT_FUNCTIONS[rope_type](text_config, "cpu")


def mrope_frequencies(freqs: torch.Tensor, section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """[3, ..., hd/2] per-axis angles -> [..., hd/2], each frequency taken from one axis.

    In sections (Qwen2-VL) the first ``section[0]`` frequencies follow the temporal axis, the
    next ``section[1]`` the rows, the rest the columns. Interleaved (Qwen3-VL) frequency
    ``j`` follows the rows where ``j % 3 == 1 and j < 3 * section[1]``, the columns where
    ``j % 3 == 2 and j < 3 * section[2]``, the temporal axis otherwise.
    """
    if not interleaved:
        parts = freqs.split(list(section), dim=-1)
        return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
    # Elementwise selection only: no boolean indexing, which would wait on the device inside a CUDA graph.
    j = torch.arange(freqs.shape[-1], device=freqs.device)
    rows = (j % 3 == 1) & (j < 3 * section[1])
    cols = (j % 3 == 2) & (j < 3 * section[2])
    return torch.where(rows, freqs[1], torch.where(cols, freqs[2], freqs[0]))


def split_visual_additions(inputs_embeds: torch.Tensor, cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``inputs_embeds`` [B,T,W] -> (embeddings [B,T,H], deepstack additions [B,T,D,H] or None)."""
    h = cfg.hidden_size
    if inputs_embeds.shape[-1] == h:
        return inputs_embeds, None
    if inputs_embeds.shape[-1] != cfg.embed_width:
        raise ValueError(f"inputs_embeds width {inputs_embeds.shape[-1]} is neither {h} nor {cfg.embed_width}")
    return inputs_embeds[..., :h], reshape_tail(inputs_embeds[..., h:], 2, cfg.deepstack_layers, h)


def widen_embeds(embeds: torch.Tensor, width: int) -> torch.Tensor:
    """``embeds`` [..., H] padded with zeros to ``width``: rows without deepstack additions."""
    return embeds if embeds.shape[-1] == width else F.pad(embeds, (0, width - embeds.shape[-1]))


class RMSNorm(nn.Module):
    """RMSNorm; with an ``offset`` (Gemma: 1) it scales by ``offset + weight`` in float32
    before casting back, as Gemma's norm does."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _ReshapeTail(torch.autograd.Function):
    """``x.reshape(*x.shape[:keep], *tail)``, exported as one ``Reshape`` with a constant shape
    (``0`` keeps a dimension): the dynamic batch and token axes need no shape arithmetic."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: int, tail: tuple[int, ...]) -> torch.Tensor:
        return x.reshape(*x.shape[:keep], *tail)

    @staticmethod
    def symbolic(g, x, keep: int, tail: tuple[int, ...]):
        dims = [0] * keep + list(tail)
        if -1 not in dims:  # the exporter's shape inference wants a -1 beside any 0: infer the last kept dim
            dims[keep - 1] = -1
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(dims, dtype=torch.int64)))


def reshape_tail(x: torch.Tensor, keep: int, *tail: int) -> torch.Tensor:
    """Keep the first ``keep`` dimensions of ``x`` and reshape the rest to ``tail`` (one ``-1`` allowed)."""
    if torch.onnx.is_in_onnx_export():
        return _ReshapeTail.apply(x, keep, tail)
    return x.reshape(*x.shape[:keep], *tail)


def _linear(x: torch.Tensor, weight_t: torch.Tensor | PackedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    y = weight_t.matmul(x) if isinstance(weight_t, PackedMatrix) else x @ weight_t
    return y if bias is None else y + bias


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              groups: int, scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention: q [B,heads,T,hd], keys/values [B,kv_heads,S,hd].

    With no mask, one new token attends to all of the past; more new tokens with no past
    attend causally, which takes the fused (flash) kernels where an explicit mask would not.
    ``scale`` replaces ``head_dim ** -0.5``.
    """
    # A branch, not the comparison's value: compiled for any length the comparison is symbolic, and
    # the attention takes only a plain bool.
    causal = False
    if mask is None and q.shape[2] > 1 and keys.shape[2] == q.shape[2]:
        causal = True
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=groups > 1, is_causal=causal,
                                          scale=scale)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, qkv, offset = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.norm_offset
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, offset)
        self.post_attention_norm = RMSNorm(h, cfg.rms_norm_eps, offset)  # the norm before the MLP
        # Gemma's sandwich: the attention and MLP outputs are normed before their residual adds.
        self.attn_out_norm = RMSNorm(h, cfg.rms_norm_eps, offset) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(h, cfg.rms_norm_eps, offset) if cfg.sandwich_norms else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.qkv_t = nn.Parameter(torch.empty(h, qkv))
        self.qkv_bias = nn.Parameter(torch.zeros(qkv)) if cfg.qkv_bias else None
        self.o_t = nn.Parameter(torch.empty(cfg.q_size, h))
        self.o_bias = nn.Parameter(torch.zeros(h)) if cfg.o_bias else None
        self.gate_up_t = nn.Parameter(torch.empty(h, 2 * cfg.intermediate_size))
        self.gate_up_bias = nn.Parameter(torch.zeros(2 * cfg.intermediate_size)) if cfg.mlp_bias else None
        self.down_t = nn.Parameter(torch.empty(cfg.intermediate_size, h))
        self.down_bias = nn.Parameter(torch.zeros(h)) if cfg.mlp_bias else None

    def forward(self, x, cos, sin, past_k, past_v, mask):
        """x [B,T,H]; past_k/v [B,S,kvh,hd] gathered from the pool; returns (x, k, v) with k/v [B,T,kvh,hd]."""
        cfg = self.cfg
        qkv = self.qkv(x)
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = reshape_tail(q, 2, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = reshape_tail(k, 2, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = reshape_tail(v, 2, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        new_k = k.transpose(1, 2)
        keys = torch.cat((past_k, new_k), dim=1).transpose(1, 2)
        values = torch.cat((past_v, v), dim=1).transpose(1, 2)
        attn = attention(q, keys, values, mask, cfg.num_heads // cfg.num_kv_heads, cfg.attn_scale)
        attn = reshape_tail(attn.transpose(1, 2), 2, cfg.q_size)
        return self.after_attention(x, attn), new_k, v

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The layer up to its attention: the q|k|v product of the normed input (RoPE not applied)."""
        return _linear(self.input_norm(x), self.qkv_t, self.qkv_bias)

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer from its attention's output ``attn`` [..., q_size] on: the o product, the MLP
        and both residual adds. (Batched decode steps run the attention between this and
        :meth:`qkv` as a kernel over the paged pool.)"""
        cfg = self.cfg
        x = x + _normed(self.attn_out_norm, _linear(attn, self.o_t, self.o_bias))
        gate_up = _linear(self.post_attention_norm(x), self.gate_up_t, self.gate_up_bias)
        gate, up = gate_up[..., :cfg.intermediate_size], gate_up[..., cfg.intermediate_size:]
        return x + _normed(self.mlp_out_norm, _linear(self.act(gate) * up, self.down_t, self.down_bias))


def _normed(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class Decoder(nn.Module):
    """The text decoder. ``forward`` implements the decoder engine contract."""

    def __init__(self, cfg: DecoderConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 local_rope: tuple[torch.Tensor, float] | None = None) -> None:
        """``local_rope`` (inverse frequencies, scaling) is the sliding layers' own RoPE (Gemma 3:
        base 1e4 where the global layers use 1e6); None: they share the global one."""
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head_t = nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size))
        # Tied checkpoints keep one matrix: the lookup reads columns of the transposed head.
        self.embed = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling
        local_freq, self.local_attention_scaling = local_rope if local_rope is not None else (None, attention_scaling)
        self.register_buffer("local_inv_freq", None if local_freq is None else local_freq.float(), persistent=False)

    @property
    def embed_table(self) -> torch.Tensor:
        """[vocab, hidden] token embeddings (the transposed head, for tied checkpoints)."""
        return self.lm_head_t.t() if self.embed is None else self.embed

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        embeds = F.embedding(ids, self.embed_table)
        if self.cfg.embed_scale != 1.0:  # Gemma: the scale in the table's dtype, as transformers rounds it
            embeds = embeds * torch.tensor(self.cfg.embed_scale, dtype=embeds.dtype)
        return embeds

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [B, 1, T, head_dim] for [B,T] positions, or [3,B,T] with M-RoPE;
        ``local``: the sliding layers' own RoPE where they have one."""
        local = local and self.local_inv_freq is not None
        inv_freq = self.local_inv_freq if local else self.inv_freq
        scaling = self.local_attention_scaling if local else self.attention_scaling
        freqs = position_ids[..., None].float() * inv_freq
        if self.cfg.mrope_section is not None:
            if position_ids.dim() == 2:
                freqs = freqs.expand(3, *freqs.shape)
            freqs = mrope_frequencies(freqs, self.cfg.mrope_section, self.cfg.mrope_interleaved)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scaling).to(dtype)[:, None]
        sin = (emb.sin() * scaling).to(dtype)[:, None]
        return cos, sin

    def forward(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        """Decoder engine step.

        inputs_embeds [B,T,H] (or [B,T,embed_width] with deepstack additions); position_ids [B,T] or
        [3,B,T]; k_pool/v_pool [layers, blocks, block_size, kv_heads, head_dim]; block_tables [B, max_blocks] (int64);
        context_lens [B] tokens already in the pool. Returns logits [B, vocab] of the last
        position and new_k/new_v [layers, B, T, kv_heads, head_dim].

        ``image_groups`` [B,T] (families with ``bidirectional_images`` only): for each new
        token, which image run it belongs to (-1 for text); tokens of one run see each other.
        """
        tokens = inputs_embeds.shape[1]
        slots, mask = past_slots_and_mask(block_tables, context_lens, k_pool.shape[2], tokens)
        mask, window_mask = layer_masks(self.cfg, mask, context_lens, slots.shape[1], tokens, image_groups)
        return self.run_layers(inputs_embeds, position_ids, past_reader(k_pool, v_pool, slots), mask,
                               window_mask=window_mask)

    def run_layers(self, inputs_embeds, position_ids, read_past, mask, layer_fn=None, last=None, window_mask=None):
        """The layers and the head over a past that ``read_past(i)`` returns for layer ``i`` as
        (k, v) ``[B,S,kvh,hd]``, under ``mask`` ``[B,1,T,S+T]`` (None: all of the past, and the new tokens causally).
        Sliding layers attend under ``window_mask`` instead, and take the local RoPE.
        ``layer_fn(layer, *inputs)`` replaces a layer's call (a compiled forward on GPUs).
        The logits are those of position ``last`` (``[B]``; None: the last position).

        ``forward`` reads the exact past; the CUDA graphs' compiled layers read whole blocks
        under a mask, so that no shape depends on the values of their inputs. (The ONNX graph
        arranges the same arithmetic its own way: ``backends.onnx.graphs.GraphLayer``.)
        """
        cfg = self.cfg
        rope = self.rope(position_ids, inputs_embeds.dtype)
        local_rope = self.rope(position_ids, inputs_embeds.dtype, local=True) if cfg.has_sliding_layers else rope
        x, additions = split_visual_additions(inputs_embeds, cfg)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            past_k, past_v = read_past(i)
            sliding = cfg.is_sliding(i)
            inputs = (x, *(local_rope if sliding else rope), past_k, past_v, window_mask if sliding else mask)
            x, k, v = layer(*inputs) if layer_fn is None else layer_fn(layer, *inputs)
            if additions is not None and i < self.cfg.deepstack_layers:
                x = x + additions[:, :, i]
            new_k.append(k)
            new_v.append(v)
        x = x[:, -1] if last is None else x.gather(1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))[:, 0]
        return self.logits(x), torch.stack(new_k), torch.stack(new_v)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head over the last layer's output: the final norm, then the vocabulary product."""
        return self.vocabulary(self.norm(x))

    def vocabulary(self, x: torch.Tensor) -> torch.Tensor:
        """The head's vocabulary product of rows already through the final norm."""
        return _linear(x, self.lm_head_t, None)


def past_slots_and_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                        new_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flat pool slots of every past token, [B, S] with S = max(context_lens), and the mask.

    The mask is None when every row's past is full length and only one token is new (the
    common batch-1 decode step), or when no row has a past (a prompt's first chunk: plain
    causal attention), so attention takes its unmasked, fused path.
    """
    b = block_tables.shape[0]
    past = int(context_lens.max()) if b else 0
    offsets = torch.arange(past, device=block_tables.device)
    slots = block_tables.gather(1, (offsets // block_size).expand(b, past)) * block_size + offsets % block_size
    uniform = bool((context_lens == past).all())
    if uniform and (new_tokens == 1 or past == 0):  # one token, or a first chunk: causal by itself
        return slots, None
    return slots, explicit_mask(context_lens, past, new_tokens)


def layer_masks(cfg: DecoderConfig, mask: torch.Tensor | None, context_lens: torch.Tensor, past: int,
                new_tokens: int, image_groups: torch.Tensor | None = None):
    """(global layers' mask, sliding layers' mask) over ``past`` + ``new_tokens`` keys, from
    the causal ``mask`` of :func:`past_slots_and_mask` or :func:`whole_block_slots_and_mask`
    (None: plain causal). Without sliding layers or image groups ``mask`` is left as it is."""
    if not cfg.has_sliding_layers and image_groups is None:
        return mask, None
    mask = explicit_mask(context_lens, past, new_tokens) if mask is None else mask
    if image_groups is not None:
        mask = with_image_groups(mask, image_groups.to(mask.device))
    window = mask & window_band(context_lens, past, new_tokens, cfg.sliding_window) if cfg.has_sliding_layers else None
    return mask, window


def explicit_mask(context_lens: torch.Tensor, past: int, new_tokens: int) -> torch.Tensor:
    """[B,1,T,past+T] bool: each row's own past (``context_lens``), then the new tokens causally."""
    b, device = context_lens.shape[0], context_lens.device
    past_ok = torch.arange(past, device=device)[None, :] < context_lens[:, None]  # [B, S]
    causal = torch.ones(new_tokens, new_tokens, dtype=torch.bool, device=device).tril()
    mask = torch.cat((past_ok[:, None, :].expand(b, new_tokens, past), causal.expand(b, -1, -1)), dim=-1)
    return mask[:, None]


def with_image_groups(mask: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``mask`` [B,1,T,S+T] where new tokens of one image run (``groups`` [B,T], -1 for text)
    also see the run's later tokens: an image attends to itself in both directions."""
    tokens = groups.shape[1]
    same = (groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] >= 0)
    past = mask[..., :mask.shape[-1] - tokens]
    return torch.cat((past, mask[..., -tokens:] | same[:, None]), dim=-1)


def window_band(context_lens: torch.Tensor, past: int, new_tokens: int, window: int) -> torch.Tensor:
    """[B,1,T,past+T] bool: the keys less than ``window`` tokens before each new token (a
    sliding layer's view; keys after the token are left to the causal mask). Past key ``s``
    is token ``s``; new key ``j`` is token ``context + j``."""
    device = context_lens.device
    new = context_lens[:, None] + torch.arange(new_tokens, device=device)  # [B, T] token index of each query
    keys = torch.cat((torch.arange(past, device=device).expand(new.shape[0], past), new), dim=-1)
    return (keys[:, None, :] > new[:, :, None] - window)[:, None]


def past_reader(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor):
    """``read_past`` for ``run_layers``: layer ``i``'s K/V at ``slots`` [B, S] of the pools."""
    return lambda i: (gather_past(k_pool[i], slots), gather_past(v_pool[i], slots))


def gather_past(pool_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, kvh, hd] pool of one layer, [B,S] slots -> [B,S,kvh,hd]."""
    flat = pool_layer.view(-1, *pool_layer.shape[2:])
    return flat[slots]


def load_decoder_weights(decoder: Decoder, tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``decoder`` from Hugging Face text-model tensors (``layers.0.self_attn.q_proj.weight``...).

    ``tensors`` holds names relative to the text model, plus ``lm_head.weight`` when the
    head is not tied. Missing or unexpected names are errors: a half-loaded decoder
    generates plausible garbage.
    """
    cfg = decoder.cfg
    remaining = dict(tensors)

    def take(name: str) -> torch.Tensor:
        try:
            return remaining.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint lacks decoder weight {name!r}") from None

    def assign(param: nn.Parameter | None, value: torch.Tensor) -> None:
        if param.shape != value.shape:
            raise ValueError(f"shape {tuple(value.shape)} does not fit {tuple(param.shape)}")
        param.data = value.to(param.dtype).contiguous()

    def product(owner: nn.Module, name: str, parts: list) -> None:
        """Fill the ``[in, out]`` matrix ``owner.name`` from its parts' ``[out, in]`` weights, stacked
        along the output; low-bit parts stay packed where the kernels can read them."""
        param = getattr(owner, name)
        if all(isinstance(p, QuantizedWeight) for p in parts) and why_not_packable(parts) is None:
            packed = pack_product(parts)
            if packed.shape != (param.shape[1], param.shape[0]):
                raise ValueError(f"{parts[0].name}: shape {list(packed.shape)} does not fit {list(param.shape[::-1])}")
            delattr(owner, name)
            setattr(owner, name, packed)
            return
        dense = [p.dequantize(param.dtype) if isinstance(p, QuantizedWeight) else p for p in parts]
        assign(param, torch.cat(dense).t())

    with torch.no_grad():
        for i, layer in enumerate(decoder.layers):
            p = f"layers.{i}."
            product(layer, "qkv_t", [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            if cfg.qkv_bias:
                assign(layer.qkv_bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            product(layer, "o_t", [take(p + "self_attn.o_proj.weight")])
            if cfg.o_bias:
                assign(layer.o_bias, take(p + "self_attn.o_proj.bias"))
            product(layer, "gate_up_t", [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            product(layer, "down_t", [take(p + "mlp.down_proj.weight")])
            if cfg.mlp_bias:
                assign(layer.gate_up_bias, torch.cat((take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias"))))
                assign(layer.down_bias, take(p + "mlp.down_proj.bias"))
            assign(layer.input_norm.weight, take(p + "input_layernorm.weight"))
            if cfg.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output
                assign(layer.attn_out_norm.weight, take(p + "post_attention_layernorm.weight"))
                assign(layer.post_attention_norm.weight, take(p + "pre_feedforward_layernorm.weight"))
                assign(layer.mlp_out_norm.weight, take(p + "post_feedforward_layernorm.weight"))
            else:
                assign(layer.post_attention_norm.weight, take(p + "post_attention_layernorm.weight"))
            if cfg.qk_norm:
                assign(layer.q_norm.weight, take(p + "self_attn.q_norm.weight"))
                assign(layer.k_norm.weight, take(p + "self_attn.k_norm.weight"))
        assign(decoder.norm.weight, take("norm.weight"))
        embed = take("embed_tokens.weight")
        head = remaining.pop("lm_head.weight", None)
        if cfg.tie_word_embeddings:
            assign(decoder.lm_head_t, embed.t())
        else:
            if head is None:
                raise KeyError("checkpoint lacks 'lm_head.weight' and does not tie embeddings")
            assign(decoder.embed, embed)
            product(decoder, "lm_head_t", [head])
    remaining.pop("rotary_emb.inv_freq", None)
    if remaining:
        raise KeyError(f"unexpected decoder weights: {sorted(remaining)[:8]}")


def whole_block_slots_and_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                               new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of every position the block tables cover, [B, width * block_size], and the mask.

    No shape depends on the values of the inputs, so graphs (CUDA graphs, ONNX) built for a
    batch and table width replay for any context length; positions past ``context_lens``
    are masked out.
    """
    b, width = block_tables.shape
    offsets = torch.arange(width * block_size, device=block_tables.device)
    slots = block_tables.repeat_interleave(block_size, dim=1) * block_size + offsets % block_size
    past_ok = offsets[None, :] < context_lens[:, None]
    causal = torch.ones(new_tokens, new_tokens, dtype=torch.bool, device=block_tables.device).tril()
    mask = torch.cat((past_ok[:, None, :].expand(b, new_tokens, -1), causal.expand(b, -1, -1)), dim=-1)
    return slots, mask[:, None]
