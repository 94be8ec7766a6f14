"""The weight formats ``edgeinfer bench gpu`` compares, and the quantized checkpoints it runs.

A format is the checkpoint as it is (named by the dtype it runs in: ``bf16``, ``fp16``,
``fp32``) or a weight-only quantization of it (``w8a16``, ``w4a16``). A quantized checkpoint
is written once by ``edgeinfer quantize``'s library call (round to nearest, min-max scales,
symmetric) into the cache folder beside the checkpoint it comes from, under a name that
carries a key over what it depends on: the source checkpoint's fingerprint, the quantizer's
settings, the quantizer's own code and the compressed-tensors version. A changed shape or
quantizer gets a new folder; an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# format: (the layers' bits, the lm_head's bits; None: the head stays in the checkpoint's dtype).
# ``-h8``: the lm_head is int8 per channel too (``edgeinfer quantize --lm-head int8``): at batch 1
# a 2B model's bf16 head is two fifths of the bytes a 4-bit step reads, a quarter of an 8-bit one's.
# ``-h4``: it is 4-bit in the layers' groups (``--lm-head int4``), about half the int8 head's bytes (with the scales).
QUANTIZED_BITS = {"w8a16": (8, None), "w8a16-h8": (8, 8), "w4a16": (4, None), "w4a16-h8": (4, 8), "w4a16-h4": (4, 4)}
FORMATS = (*DTYPE_NAMES.values(), *QUANTIZED_BITS)
QUANTIZE_METHOD = "rtn"
# The modules whose code decides what an ``rtn`` checkpoint holds.
QUANTIZER_MODULES = ("edgeinfer.quant.compress", "edgeinfer.quant.quantize")


def dense_format(dtype: str) -> str:
    """The name of the checkpoint as it is, run in ``dtype``: ``bf16`` for ``bfloat16``."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype]


def parse_weights(text: str, dtype: str) -> tuple[str, ...]:
    """``bf16,w8a16,w4a16`` as a tuple of formats, in the given order, each once. The dense
    format must be the one ``dtype`` runs: the checkpoint is not converted."""
    formats = tuple(dict.fromkeys(w.strip().lower() for w in text.split(",") if w.strip()))
    check_weights(formats, dtype)
    return formats


def check_weights(formats: tuple[str, ...], dtype: str) -> None:
    if not formats:
        raise ValueError(f"no weight format given; choose from {', '.join(FORMATS)}")
    unknown = [w for w in formats if w not in FORMATS]
    if unknown:
        raise ValueError(f"unknown weight formats {unknown}; choose from {', '.join(FORMATS)}")
    dense = dense_format(dtype)
    other = [w for w in formats if w in DTYPE_NAMES.values() and w != dense]
    if other:
        raise ValueError(f"weight format {other[0]} with --dtype {dtype}: the checkpoint runs as {dense} "
                         f"(pass --dtype to run it in another dtype)")


def is_quantized(fmt: str) -> bool:
    return fmt in QUANTIZED_BITS


@dataclass(frozen=True, slots=True)
class QuantizedCheckpointSpec:
    """One quantized checkpoint the benchmark runs: what it comes from and how it is made."""

    source: Path
    bits: int
    group_size: int
    method: str = QUANTIZE_METHOD
    lm_head_bits: int | None = None
    # The dtype the source is quantized in (`edgeinfer quantize --dtype`): the one the benchmark runs,
    # so that scales are in the activations' dtype, as a checkpoint quantized from bf16 weights has them
    dtype: str | None = None

    @classmethod
    def of(cls, fmt: str, source: Path, group_size: int, dtype: str | None = None) -> "QuantizedCheckpointSpec":
        """``dtype``: the one the benchmark runs; None where it is the checkpoint's own (quantized as it is)."""
        if dtype is not None and dtype == checkpoint_dtype(source):
            dtype = None
        bits, head_bits = QUANTIZED_BITS[fmt]
        return cls(source, bits, group_size, lm_head_bits=head_bits, dtype=dtype)

    @property
    def format(self) -> str:
        return f"w{self.bits}a16" + (f"-h{self.lm_head_bits}" if self.lm_head_bits else "")

    def key(self) -> str:
        """A digest of everything the written checkpoint depends on."""
        from edgeinfer.artifacts import checkpoint_fingerprint

        digest = hashlib.sha256()
        # absent without a quantized head, and "lm_head int8" as before: older keys stay valid
        head = (f"lm_head int{self.lm_head_bits}",) if self.lm_head_bits else ()
        dtype = (f"dtype {self.dtype}",) if self.dtype else ()  # likewise
        for part in (checkpoint_fingerprint(self.source), str(self.bits), str(self.group_size), self.method, *head,
                     *dtype, quantizer_identity()):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def folder(self, cache: Path) -> Path:
        """Where it is kept: beside its source's name under ``cache``, the key in the name."""
        return cache / f"{self.source.name}-{self.format}-g{self.group_size}-{self.method}-{self.key()[:16]}"


def checkpoint_dtype(source: Path) -> str | None:
    """The dtype a checkpoint's config declares, as transformers reads it (``float32``), or None where
    it declares none or there is no config.json."""
    from edgeinfer.models.loader import read_config

    if not (source / "config.json").is_file():
        return None
    dtype = read_config(source).dtype
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def quantizer_identity() -> str:
    """The quantizer's code and the compressed-tensors version: a change to either rebuilds."""
    import importlib
    import importlib.metadata

    digest = hashlib.sha256()
    for name in QUANTIZER_MODULES:
        digest.update(Path(importlib.import_module(name).__file__).read_bytes())
    digest.update(importlib.metadata.version("compressed-tensors").encode())
    return digest.hexdigest()


def quantized_checkpoint(spec: QuantizedCheckpointSpec, cache: Path, steps=None) -> Path:
    """The quantized checkpoint of ``spec`` under ``cache``, written once (into a temporary
    folder renamed at the end, so an interrupted run is never taken for a finished one).
    ``steps`` receives the quantizer's progress (:class:`edgeinfer.progress.Steps`)."""
    from edgeinfer.quant.compress import Method, QuantizeOptions, QuantSpec
    from edgeinfer.quant.quantize import quantize_checkpoint

    path = spec.folder(cache)
    if (path / "config.json").is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=cache))
    try:
        quant = QuantSpec(spec.bits, spec.group_size, lm_head_bits=spec.lm_head_bits)
        options = QuantizeOptions(spec.source, scratch, quant, Method(spec.method), dtype=spec.dtype)
        quantize_checkpoint(options, steps)
        scratch.rename(path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def format_checkpoint(source: Path, fmt: str, cache: Path, group_size: int, dtype: str, steps=None,
                      log: Callable[[str], None] = print) -> Path:
    """The checkpoint ``fmt`` runs: ``source`` itself for a dense format, else its quantized copy
    under ``cache`` (:func:`quantized_checkpoint`, written once, ``log`` told when), quantized in
    ``dtype``."""
    if not is_quantized(fmt):
        return source
    spec = QuantizedCheckpointSpec.of(fmt, source, group_size, dtype)
    folder = spec.folder(cache)
    if not (folder / "config.json").is_file():
        log(f"[bench] quantizing {source.name} to {fmt} ({spec.method}, group {group_size}) into {folder}")
    return quantized_checkpoint(spec, cache, steps)
