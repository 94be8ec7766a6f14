"""Weight-only quantization of a checkpoint's language model, written as compressed-tensors.

``quantize_checkpoint`` (in :mod:`.quantize`) reads a Hugging Face folder, quantizes the linear layers of the
language model's decoder layers (never the embeddings, the vision tower or the projector;
the ``lm_head`` only when asked, to int8 per channel or 4-bit groups), and writes the folder the way
llm-compressor writes a W4A16 / W8A16 checkpoint: the schemes attached to the modules,
``ModelCompressor`` packing them (``pack-quantized``: ``weight_packed``, ``weight_scale``,
``weight_zero_point`` when asymmetric, ``weight_shape``), ``config.json`` carrying the
``quantization_config`` it derives (``config_groups`` targeting ``Linear``, every Linear left
in full precision named in ``ignore``). transformers (with compressed-tensors installed) and
vLLM load the folder unchanged.

Scales are min-max per group (or per output channel), as llm-compressor's default observer
computes them; ``awq`` first moves activation outliers into the weights (:mod:`.awq`).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import torch

from edgeinfer.errors import (
    ModelLoadError,
    QuantizeSettingsError,
    UnsupportedArchitectureError,
)
from edgeinfer.progress import Steps

SUPPORTED_BITS = (4, 8)
REPORT_NAME = "quantize-report.json"
FORMAT = "pack-quantized"
LM_HEAD = "lm_head"
# Files the new folder gets from the quantizer, not from the source folder.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
WRITTEN_HERE = ("config.json", "generation_config.json", REPORT_NAME)


class Method(str, Enum):
    rtn = "rtn"
    awq = "awq"


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """What each quantized weight becomes. ``group_size`` None: one scale per output channel.
    ``lm_head_bits``: None keeps the output projection as it is; 8 makes it int8 per row, 4 makes
    it 4-bit in the layers' groups (:meth:`lm_head_args`)."""

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    lm_head_bits: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise QuantizeSettingsError("--bits", self.bits, " or ".join(map(str, SUPPORTED_BITS)))
        if self.lm_head_bits is not None and self.lm_head_bits not in SUPPORTED_BITS:
            raise QuantizeSettingsError("--lm-head", self.lm_head_bits, " or ".join(f"int{b}" for b in SUPPORTED_BITS))
        if self.group_size is not None and self.group_size < 1:
            raise QuantizeSettingsError("--group-size", self.group_size,
                                        "a positive group size, or 0 / -1 for one scale per output channel")

    @classmethod
    def from_options(cls, bits: int, group_size: int, symmetric: bool = True,
                     lm_head_bits: int | None = None) -> QuantSpec:
        """The CLI's spelling: a group size of 0 or -1 means per output channel."""
        return cls(bits, None if group_size in (0, -1) else group_size, symmetric, lm_head_bits)

    def weight_args(self):
        """The compressed-tensors ``QuantizationArgs`` of the language model's linear layers:
        llm-compressor's W4A16 / W8A16 preset with this spec's group size and symmetry."""
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationStrategy,
            QuantizationType,
        )

        strategy = QuantizationStrategy.CHANNEL if self.group_size is None else QuantizationStrategy.GROUP
        return QuantizationArgs(num_bits=self.bits, type=QuantizationType.INT, strategy=strategy,
                                group_size=self.group_size, symmetric=self.symmetric, dynamic=False)

    def lm_head_args(self):
        """The output projection's ``QuantizationArgs``, symmetric: int8 with one scale per vocabulary
        row (W8A16's channel scheme), or 4-bit in the layers' groups (one scale per row where they
        have none), as the ONNX Runtime int4 graphs hold it."""
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationStrategy,
            QuantizationType,
        )

        if self.lm_head_bits is None:
            raise ValueError("this spec keeps the lm_head as it is")
        group = self.group_size if self.lm_head_bits == 4 else None
        strategy = QuantizationStrategy.CHANNEL if group is None else QuantizationStrategy.GROUP
        return QuantizationArgs(num_bits=self.lm_head_bits, type=QuantizationType.INT, strategy=strategy,
                                group_size=group, symmetric=True, dynamic=False)


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    model: Path
    out: Path
    spec: QuantSpec = QuantSpec()
    method: Method = Method.rtn
    calibration: Path | None = None
    samples: int = 64
    force: bool = False
    # Calibration rows kept per layer group for the scale search (bounds memory).
    max_tokens: int = 512
    seed: int = 0
    # The dtype the checkpoint is loaded in, and so the scales and the unquantized weights are
    # written in (llm-compressor quantizes a model in the dtype it was loaded in); None: its own.
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in LOAD_DTYPES:
            raise QuantizeSettingsError("--dtype", self.dtype, ", ".join(LOAD_DTYPES))
        if self.samples < 1:
            raise QuantizeSettingsError("--samples", self.samples, "1 or more")
        if self.calibration is not None and self.method is not Method.awq:
            raise QuantizeSettingsError("--calibration with --method", self.method.value,
                                        "awq (rtn needs no calibration data)")


@dataclass(frozen=True, slots=True)
class LayerReport:
    """One quantized layer: its shape, settings and relative error.

    ``weight_error`` is ||Q(W) - W|| / ||W|| of the weight as stored (after any AWQ scaling);
    ``output_error`` the same ratio of the layer's outputs on the calibration rows (AWQ only);
    ``alpha`` the exponent AWQ chose for the layer's group.
    """

    name: str
    shape: tuple[int, int]
    bits: int
    group_size: int | None
    weight_error: float
    output_error: float | None = None
    alpha: float | None = None


@dataclass(frozen=True, slots=True)
class QuantizeReport:
    model: str
    out: str
    method: str
    bits: int
    group_size: int | None
    symmetric: bool
    calibration: str | None
    samples: int
    layers: list[LayerReport] = field(default_factory=list)
    dtype: str | None = None  # the dtype the model was quantized in (its scales' and unquantized weights')

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- which layers


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's decoder layers (the vision tower and projector are elsewhere)."""
    return list(model.get_decoder().layers)


def language_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every linear layer inside the language model's decoder layers, by its name in ``model``."""
    ids = {id(layer) for layer in decoder_layers(model)}
    out: dict[str, torch.nn.Linear] = {}
    for name, module in model.named_modules():
        if id(module) in ids:
            out.update({f"{name}.{sub}": linear for sub, linear in module.named_modules()
                        if isinstance(linear, torch.nn.Linear)})
    return out


def check_group_size(linears: dict[str, torch.nn.Linear], spec: QuantSpec) -> None:
    if spec.group_size is None:
        return
    for name, linear in linears.items():
        if linear.in_features % spec.group_size:
            raise QuantizeSettingsError(
                "--group-size", spec.group_size,
                f"a divisor of every input width ({name} takes {linear.in_features}), or 0 for per channel")


# --------------------------------------------------------------------------- scales and fake quantization


def minmax_qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of ``weight`` [out, in]: min-max per group of ``args.group_size``
    input columns (``[out, in / group]``), or per output row (``[out, 1]``)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    rows = weight.shape[0]
    grouped = weight.reshape(rows, -1, args.group_size) if args.group_size else weight.reshape(rows, 1, -1)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    return scale, zero_point


def fake_quantized(weight: torch.Tensor, args) -> torch.Tensor:
    """``weight`` quantized with min-max scales and dequantized again, in its own dtype."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    scale, zero_point = minmax_qparams(weight, args)
    return fake_quantize(weight, scale, zero_point, args)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.detach().float()
    return float((approx.detach().float() - exact).norm() / exact.norm().clamp_min(1e-12))


# --------------------------------------------------------------------------- the whole checkpoint


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise QuantizeSettingsError("OUT", str(out), "a folder that does not exist or is empty")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise QuantizeSettingsError("OUT", f"{out} (not empty)",
                                    "a folder that does not exist or is empty (override: --force)")


LOAD_DTYPES = ("float32", "float16", "bfloat16")


def load_model(folder: Path, dtype: str | None = None) -> torch.nn.Module:
    """The checkpoint in transformers, in ``dtype`` (one of :data:`LOAD_DTYPES`; None: its own),
    after checking edgeinfer knows its family."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from edgeinfer.models.registry import (
        adapter_for,
        not_yet_supported,
        supported_architectures,
    )

    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: no config.json; MODEL must be a Hugging Face checkpoint folder")
    config = AutoConfig.from_pretrained(folder)
    architectures = list(getattr(config, "architectures", None) or [])
    if adapter_for(architectures) is None:
        raise UnsupportedArchitectureError(architectures, supported_architectures(), not_yet_supported(architectures))
    if getattr(config, "quantization_config", None) is not None:
        raise QuantizeSettingsError("MODEL", f"{folder} (already quantized)", "a checkpoint in full precision")
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=getattr(torch, dtype) if dtype else "auto").eval()


def untie_lm_head(model: torch.nn.Module) -> None:
    """Give ``lm_head`` its own weight: quantized rows must not replace the input embeddings they share."""
    head = model.get_output_embeddings()
    if head.weight is not model.get_input_embeddings().weight:
        return
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    for config in (model.config, model.config.get_text_config()):
        config.tie_word_embeddings = False


def quantization_config(model: torch.nn.Module, linears: dict[str, torch.nn.Linear], spec: QuantSpec):
    """llm-compressor's recipe shape: one scheme targeting ``Linear`` (and ``lm_head`` first when
    asked), every other Linear ignored by name."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )

    groups = {}
    if spec.lm_head_bits is not None:
        groups["group_0"] = QuantizationScheme(targets=[LM_HEAD], weights=spec.lm_head_args())
    groups[f"group_{len(groups)}"] = QuantizationScheme(targets=["Linear"], weights=spec.weight_args())
    keep = set(linears) | ({LM_HEAD} if spec.lm_head_bits is not None else set())
    ignore = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and name not in keep]
    return QuantizationConfig(config_groups=groups, ignore=ignore, format=FORMAT,
                              quantization_status=QuantizationStatus.FROZEN)


def unquantized_linears(model: torch.nn.Module) -> list[str]:
    """Every Linear left in full precision, by module name, in module order."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and getattr(module, "quantization_scheme", None) is None]


def attach_quantization(model: torch.nn.Module, linears: dict[str, torch.nn.Linear], spec: QuantSpec,
                        smoothing: dict[str, tuple[float, float]], steps: Steps) -> list[LayerReport]:
    """Attach the schemes and fill each layer's min-max scale and zero point; the weights stay
    dense here (``ModelCompressor`` packs them)."""
    from compressed_tensors.quantization import apply_quantization_config

    apply_quantization_config(model, quantization_config(model, linears, spec), show_progress=False)
    targets = dict(linears)
    if spec.lm_head_bits is not None:
        targets[LM_HEAD] = model.get_output_embeddings()
    advance = steps.phase("quantizing", len(targets))
    reports = []
    for name, linear in targets.items():
        reports.append(fill_qparams(name, linear, smoothing.get(name)))
        advance()
    return reports


@torch.no_grad()
def fill_qparams(name: str, linear: torch.nn.Linear, smoothed: tuple[float, float] | None) -> LayerReport:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = linear.quantization_scheme.weights
    scale, zero_point = minmax_qparams(linear.weight, args)
    linear.weight_scale.copy_(scale)
    if hasattr(linear, "weight_zero_point"):
        linear.weight_zero_point.copy_(zero_point)
    error = relative_error(fake_quantize(linear.weight, scale, zero_point, args), linear.weight)
    alpha, output_error = smoothed if smoothed else (None, None)
    return LayerReport(name, tuple(linear.weight.shape), args.num_bits, args.group_size, error, output_error, alpha)


def write_checkpoint(model: torch.nn.Module, options: QuantizeOptions) -> None:
    """Pack and save as llm-compressor does, after copying the tokenizer, processor and template files."""
    from compressed_tensors.compressors import ModelCompressor

    options.out.mkdir(parents=True, exist_ok=True)
    copy_side_files(options.model, options.out)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    # compressed-tensors renames the ignore list to the keys' on-disk spelling
    # (``vision_tower.…`` where transformers 5 names the module ``model.vision_tower.…``);
    # transformers matches ``ignore`` against its module names, so with the on-disk spelling
    # it would build the vision tower as packed layers and find no weights for them. vLLM
    # maps these module names to its own through each model's prefix mapper.
    compressor.quantization_config.ignore = unquantized_linears(model)
    compressor.compress_model(model)
    model.save_pretrained(options.out)
    compressor.update_config(str(options.out))


def copy_side_files(source: Path, out: Path) -> None:
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name not in WRITTEN_HERE:
            shutil.copy2(path, out / path.name)
