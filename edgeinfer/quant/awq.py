"""Activation-aware weight scaling (AWQ, Lin et al. 2023), as llm-compressor's AWQModifier does it.

A few input channels of a linear layer carry most of the activation magnitude; rounding
their weights costs far more output error than rounding the others. For each group of
layers that read the same input — input norm → q|k|v, the norm before the MLP → gate|up,
up → down, v → o where their widths agree — the input's mean magnitude per channel
``a`` is measured on calibration data, and for alpha on a grid in [0, 1) the scales
``s = a ** alpha`` (normalised around 1) are tried: the layers' weights are multiplied by
``s`` column-wise, quantized, and run on the calibration rows divided by ``s``. The alpha
with the least output error wins; ``s`` stays in the weights and ``1 / s`` is folded into
the op before (the norm's weight, or the previous linear's rows), so the full-precision
model computes the same function. alpha 0 is plain round-to-nearest, so the search never
does worse than it on the calibration rows.

Activations come from one pass of the model in transformers on the CPU over calibration
pictures and prompts; each group keeps its running mean magnitude and at most
``max_tokens`` input rows, so memory is bounded whatever the number of samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgeinfer.errors import QuantizeSettingsError
from edgeinfer.progress import Steps
from edgeinfer.quant.compress import (
    QuantizeOptions,
    decoder_layers,
    fake_quantized,
    relative_error,
)

GRID = 20
DEFAULT_PROMPT = "Describe the image."
PROMPTS_FILE = "prompts.txt"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Calibration draws from the demo generator's training stream (seed 0), never from the
# held-out evaluation seeds.
DEMO_CALIBRATION_SEED = 0


@dataclass(slots=True)
class SmoothGroup:
    """Linear layers that read one input, and the op that writes that input."""

    name: str
    previous: torch.nn.Module
    linears: dict[str, torch.nn.Linear]


@dataclass(slots=True)
class InputStats:
    """A group input's running sum of |x| per channel, and a bounded sample of its rows."""

    per_sample: int
    total: torch.Tensor | None = None
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, x: torch.Tensor, generator: torch.Generator) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        magnitude = x.abs().sum(0)
        self.total = magnitude if self.total is None else self.total + magnitude
        self.count += x.shape[0]
        keep = torch.randperm(x.shape[0], generator=generator)[:self.per_sample]
        self.rows.append(x[keep])

    def mean(self) -> torch.Tensor:
        return self.total / max(self.count, 1)

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


# --------------------------------------------------------------------------- groups


def smooth_groups(model: torch.nn.Module) -> list[SmoothGroup]:
    """The AWQ groups of every decoder layer, named by the linear layers they scale."""
    names = {id(module): name for name, module in model.named_modules()}
    groups = []
    for layer in decoder_layers(model):
        groups += layer_groups(layer, names)
    return groups


def layer_groups(layer: torch.nn.Module, names: dict[int, str]) -> list[SmoothGroup]:
    attn, mlp = layer.self_attn, layer.mlp
    # Gemma's post_attention_layernorm normalises the attention output; its MLP reads
    # pre_feedforward_layernorm.
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", None)
    mlp_norm = layer.post_attention_layernorm if mlp_norm is None else mlp_norm
    candidates = [
        (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]),
        (mlp_norm, [mlp.gate_proj, mlp.up_proj]),
        (mlp.up_proj, [mlp.down_proj]),
    ]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        candidates.insert(1, (attn.v_proj, [attn.o_proj]))
    return [SmoothGroup(names[id(linears[0])], previous, {names[id(m)]: m for m in linears})
            for previous, linears in candidates]


# --------------------------------------------------------------------------- calibration


def calibration_samples(folder: Path | None, n: int) -> list[tuple[Image.Image, str]]:  # noqa: F821
    """(picture, prompt) pairs: a folder's pictures with the prompts of its prompts.txt taken in
    turn (or one default question), else the demo generator's pictures and questions."""
    if folder is None:
        from edgeinfer.demo.synthetic import sample_at

        return [(s.image, s.question) for s in (sample_at(DEMO_CALIBRATION_SEED, i) for i in range(n))]
    from PIL import Image

    if not folder.is_dir():
        raise QuantizeSettingsError("--calibration", str(folder), "a folder of pictures (and prompts.txt)")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise QuantizeSettingsError("--calibration", f"{folder} (no pictures)",
                                    f"a folder holding pictures ({', '.join(IMAGE_SUFFIXES)})")
    prompts_file = folder / PROMPTS_FILE
    prompts = [line.strip() for line in prompts_file.read_text().splitlines() if line.strip()] \
        if prompts_file.is_file() else []
    prompts = prompts or [DEFAULT_PROMPT]
    return [(Image.open(images[i % len(images)]).convert("RGB"), prompts[i % len(prompts)]) for i in range(n)]


def model_inputs(processor, image, prompt: str) -> dict:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=[image], text=text, return_tensors="pt")


@torch.no_grad()
def collect_inputs(model: torch.nn.Module, processor, samples: list, groups: list[SmoothGroup],
                   max_tokens: int, seed: int, advance: Callable[[], None]) -> dict[str, InputStats]:
    """Each group's input statistics over one forward pass per calibration sample."""
    per_sample = max(1, math.ceil(max_tokens / len(samples)))
    stats = {group.name: InputStats(per_sample) for group in groups}
    generator = torch.Generator().manual_seed(seed)
    hooks = [next(iter(group.linears.values())).register_forward_pre_hook(
        lambda _m, args, name=group.name: stats[name].add(args[0], generator)) for group in groups]
    try:
        for image, prompt in samples:
            model(**model_inputs(processor, image, prompt))
            advance()
    finally:
        for hook in hooks:
            hook.remove()
    return stats


# --------------------------------------------------------------------------- the search


def normalized_scales(act_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    s = act_mean.pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def rounded(weight: torch.Tensor, args) -> torch.Tensor:
    """Min-max fake quantization in a few plain tensor ops: the same numbers as
    :func:`~edgeinfer.quant.compress.fake_quantized` (compressed-tensors' own), at a fraction of
    its cost, for the search's inner loop."""
    rows, columns = weight.shape
    grouped = weight.reshape(rows, -1, args.group_size or columns)
    low = grouped.amin(-1, keepdim=True).clamp(max=0)
    high = grouped.amax(-1, keepdim=True).clamp(min=0)
    q_min, q_max = -(2 ** (args.num_bits - 1)), 2 ** (args.num_bits - 1) - 1
    if args.symmetric:
        scale = torch.maximum(-low, high) / ((q_max - q_min) / 2)
        zero = torch.zeros_like(scale)
    else:
        scale = (high - low) / (q_max - q_min)
        zero = (q_min - low / scale).clamp(q_min, q_max).round()
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    q = (grouped / scale + zero).round().clamp(q_min, q_max)
    return ((q - zero) * scale).reshape(rows, columns)


@torch.no_grad()
def group_output_error(x: torch.Tensor, weights: list[torch.Tensor], exact: list[torch.Tensor],
                       scales: torch.Tensor, args) -> float:
    """Mean squared error against ``exact`` of the group's outputs on rows ``x`` when each weight is
    scaled by ``scales`` column-wise, quantized, and fed ``x / scales``."""
    xs = x / scales
    error = sum(float((xs @ rounded(w * scales, args).T - y).pow(2).sum()) for w, y in zip(weights, exact))
    return error / (x.shape[0] * sum(w.shape[0] for w in weights))


@torch.no_grad()
def search_scales(x: torch.Tensor, act_mean: torch.Tensor, weights: list[torch.Tensor], args,
                  grid: int = GRID) -> tuple[torch.Tensor, float]:
    """The scales (and their alpha) with the least output error, alpha in {0, 1/grid, ...}."""
    weights = [w.detach().float() for w in weights]
    exact = [x @ w.T for w in weights]
    best = None
    for i in range(grid):
        alpha = i / grid
        scales = normalized_scales(act_mean, alpha)
        error = group_output_error(x, weights, exact, scales, args)
        if best is None or error < best[0]:
            best = (error, scales, alpha)
    return best[1], best[2]


# --------------------------------------------------------------------------- applying scales


def norm_adds_one(norm: torch.nn.Module) -> bool:
    """Whether a norm scales by ``1 + weight`` (Gemma) rather than ``weight``: probed, not named."""
    probe = torch.ones(1, norm.weight.shape[0], dtype=norm.weight.dtype)
    with torch.no_grad():
        out = norm(probe)[0].float()
    w = norm.weight.float()
    return bool((out - (1 + w)).abs().max() < (out - w).abs().max())


@torch.no_grad()
def fold_inverse(previous: torch.nn.Module, scales: torch.Tensor) -> None:
    """Divide ``previous``'s output channels by ``scales``."""
    if isinstance(previous, torch.nn.Linear):
        previous.weight.div_(scales.to(previous.weight.dtype)[:, None])
        if previous.bias is not None:
            previous.bias.div_(scales.to(previous.bias.dtype))
        return
    weight = previous.weight
    if norm_adds_one(previous):
        weight.copy_(((1 + weight.float()) / scales - 1).to(weight.dtype))
    else:
        weight.div_(scales.to(weight.dtype))
    if getattr(previous, "bias", None) is not None:
        previous.bias.div_(scales.to(previous.bias.dtype))


@torch.no_grad()
def apply_scales(group: SmoothGroup, scales: torch.Tensor) -> None:
    fold_inverse(group.previous, scales)
    for linear in group.linears.values():
        linear.weight.mul_(scales.to(linear.weight.dtype))


def smooth_model(model: torch.nn.Module, options: QuantizeOptions, steps: Steps) -> dict[str, tuple[float, float]]:
    """Run the calibration pass, search and apply each group's scales; returns, per linear
    layer, the alpha chosen and its quantized output's relative error on the calibration rows."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(options.model)
    except ImportError as error:  # e.g. Qwen2-VL's video processor, which needs torchvision
        raise QuantizeSettingsError(
            "--method", "awq", f"rtn here: the calibration pass runs the model through transformers' processor, "
            f"which for this checkpoint needs a package that is not installed ({str(error).strip().splitlines()[0]})"
        ) from error
    groups = smooth_groups(model)
    samples = calibration_samples(options.calibration, options.samples)
    stats = collect_inputs(model, processor, samples, groups, options.max_tokens, options.seed,
                           steps.phase("calibrating", len(samples)))
    args = options.spec.weight_args()
    advance = steps.phase("searching scales", len(groups))
    chosen: dict[str, tuple[float, float]] = {}
    for group in groups:
        x = stats[group.name].sample()
        scales, alpha = search_scales(x, stats[group.name].mean(), [m.weight for m in group.linears.values()], args)
        apply_scales(group, scales)
        for name, linear in group.linears.items():
            w = linear.weight.detach().float()
            exact = (x / scales) @ w.T
            chosen[name] = (alpha, relative_error((x / scales) @ fake_quantized(w, args).T, exact))
        advance()
    return chosen
