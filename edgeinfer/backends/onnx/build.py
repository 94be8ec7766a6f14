"""The ONNX Runtime build: what a build depends on, the build itself, its manifest.

``build_engines`` writes ``<root>/<model>/<profile>/{vision,decoder}.onnx`` and
``manifest.json`` (layout, manifest and staleness: :mod:`edgeinfer.artifacts`).
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from edgeinfer.artifacts import (
    MANIFEST_SCHEMA,
    Expected,
    GraphFormat,
    Manifest,
    checkpoint_fingerprint,
    engine_dir,
    file_sha256,
    folder_problems,
    int4_flags,
    read_manifest,
    write_manifest,
)
from edgeinfer.artifacts import build_command as artifact_build_command
from edgeinfer.backends.onnx.export import (
    DECODER_FILE,
    OPSET,
    VISION_FILE,
    check_decoder,
    check_graph,
    check_vision,
    export_decoder,
    export_vision,
    graph_files,
    graph_io,
    sample_images,
)
from edgeinfer.backends.onnx.graphs import VisionGraph, vision_graph_for
from edgeinfer.backends.onnx.quantize import Int4Options, quantize_decoder, quantize_decoder_int4, quantize_vision
from edgeinfer.errors import EngineBuildError

# Bumped whenever the exported graphs change, so that engines built by an older edgeinfer rebuild.
EXPORT_REVISION = 8  # 8: attention per K/V head (the past gathered head-major)
GRAPH_FORMAT = GraphFormat(EXPORT_REVISION, OPSET)
# fp32 graph vs torch: largest absolute logit difference allowed, relative to the logits' scale.
FP32_TOLERANCE = 1e-3

# The decoder's weights; the vision graph's are chosen apart (VisionPrecision).
Precision = Literal["fp32", "int8", "int4"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
VisionPrecision = Literal["fp32", "int8"]
VISION_PRECISIONS: tuple[VisionPrecision, ...] = get_args(VisionPrecision)
# int8 vision graph vs torch: the lowest mean cosine similarity of its embeddings allowed. The
# demo model's are 0.9997; a tiny random tower's about 0.92; a broken graph's near 0.
VISION_INT8_MIN_COSINE = 0.8


# --------------------------------------------------------------------------- what a build depends on


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """Everything an ONNX build depends on besides the checkpoint.

    ``profile`` names the profile (``custom`` for an engine configured without one) and
    ``profile_fingerprint`` is :func:`edgeinfer.profiles.profile_fingerprint` of it, None
    for ``custom``. ``precision`` ``int8`` / ``int4`` quantizes the decoder's weights (int4 as
    ``int4`` says); ``vision_precision`` ``int8`` the vision graph's.
    """

    profile: str
    profile_fingerprint: str | None
    precision: Precision = "fp32"
    block_size: int = 16
    shapes: dict[str, Any] = field(default_factory=dict)
    opset: int = OPSET
    int4: Int4Options = Int4Options()
    vision_precision: VisionPrecision = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise EngineBuildError(f"precision {self.precision!r} is not supported by the onnxruntime backend; "
                                   f"choose one of: {', '.join(PRECISIONS)}")
        if self.vision_precision not in VISION_PRECISIONS:
            raise EngineBuildError(f"vision precision {self.vision_precision!r} is not supported by the onnxruntime "
                                   f"backend; choose one of: {', '.join(VISION_PRECISIONS)}")
        if self.precision != "int4" and self.int4 != Int4Options():
            raise EngineBuildError(f"int4 options were given for a {self.precision} build",
                                   fix="--precision int4, or drop the --int4-* options")

    @classmethod
    def from_profile(cls, profile, precision: str | None = None, *, int4: Int4Options | None = None,
                     vision_precision: str = "fp32") -> "BuildSpec":
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
        return cls(profile.name, profile_fingerprint(profile), chosen, profile.kv.block_size, shapes,
                   int4=int4 or Int4Options(), vision_precision=vision_precision)  # type: ignore[arg-type]

    @classmethod
    def custom(cls, name: str = "custom", block_size: int = 16, precision: str = "fp32", *,
               int4: Int4Options | None = None, vision_precision: str = "fp32") -> "BuildSpec":
        return cls(name, None, precision, block_size, int4=int4 or Int4Options(),  # type: ignore[arg-type]
                   vision_precision=vision_precision)  # type: ignore[arg-type]

    def like_build(self, manifest: Manifest | None) -> "BuildSpec":
        """This spec with the quantization of ``manifest``'s build where that build was quantized
        (its decoder's precision and int4 options, its vision precision): a quantized build that
        has to be rebuilt stays quantized as it was asked for once. An fp32 part keeps this spec's."""
        if manifest is None:
            return self
        spec = self
        decoder = manifest.engines.get("decoder")
        if manifest.precision in PRECISIONS and manifest.precision != "fp32":
            options = ((decoder.document.get("quantization") or {}).get("options") or {}) if decoder else {}
            int4 = Int4Options.from_json(options) if manifest.precision == "int4" else Int4Options()
            spec = dataclasses.replace(spec, precision=manifest.precision, int4=int4)
        vision = manifest.engines.get("vision")
        if vision is not None and vision.precision == "int8":
            spec = dataclasses.replace(spec, vision_precision="int8")
        return spec

    def expected(self, checkpoint: str, *, any_precision: bool = False) -> Expected:
        """What a folder built from this spec and ``checkpoint`` holds; ``any_precision``: a build
        at another precision fits too (a run takes whichever precision was built)."""
        return Expected(self.profile, self.profile_fingerprint, checkpoint,
                        None if any_precision else self.precision, dataclasses.replace(GRAPH_FORMAT, opset=self.opset))


def build_command(model_dir: str | Path, spec: BuildSpec) -> str:
    return artifact_build_command("onnxruntime", model_dir, spec.profile, spec.precision) + _option_flags(spec)


def _option_flags(spec: BuildSpec) -> str:
    """The ``edgeinfer build`` flags of the spec's non-default int4 options and vision precision."""
    flags = int4_flags(spec.int4.to_json(), Int4Options().to_json())
    flags += ["--vision-precision", spec.vision_precision] if spec.vision_precision != "fp32" else []
    return "".join(f" {flag}" for flag in flags)


def library_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import transformers

    import edgeinfer

    return {"edgeinfer": getattr(edgeinfer, "__version__", "0"), "torch": torch.__version__,
            "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}


def engine_problems(folder: Path, spec: BuildSpec, checkpoint: str) -> list[str]:
    """[] when ``folder`` holds engines that fit this checkpoint and ``spec``; otherwise what is
    missing, stale or corrupt (the one check of :mod:`edgeinfer.artifacts`), or built with other
    int4 options or another vision precision."""
    problems = folder_problems(folder, spec.expected(checkpoint))
    if problems:
        return problems
    built = BuildSpec.custom().like_build(read_manifest(folder))  # as built: fp32 where not quantized
    changed = [f"int4 {name} {getattr(built.int4, name)} -> {value}" for name, value in spec.int4.to_json().items()
               if getattr(built.int4, name) != value]
    if built.vision_precision != spec.vision_precision:
        changed.append(f"vision precision {built.vision_precision} -> {spec.vision_precision}")
    return changed


# --------------------------------------------------------------------------- the build


@dataclass(frozen=True, slots=True)
class BuildResult:
    folder: Path
    manifest: Manifest
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
            from edgeinfer.progress import stderr_bars

            self._progress = stderr_bars()
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
    model_fp = checkpoint_fingerprint(model_dir)
    reasons = engine_problems(folder, spec, model_fp)
    if not reasons and not force:
        return BuildResult(folder, read_manifest(folder), skipped=True)
    if model.dtype != torch.float32 or model.decoder.lm_head_t.device.type != "cpu":
        raise EngineBuildError(f"the graphs are exported from float32 weights on the CPU, this model is "
                               f"{model.dtype} on {model.decoder.lm_head_t.device}", artifact=str(folder),
                               fix=build_command(model_dir, spec))
    graph = vision_graph_for(model)
    steps = 3 + (graph is not None) * (2 + (spec.vision_precision == "int8")) + (spec.precision != "fp32")
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.profile}-", dir=folder.parent))
    try:
        with Steps(steps, f"building {model.name}/{spec.profile}", progress) as bar:
            _build_into(work, model, model_dir, model_fp, spec, graph, bar)
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return BuildResult(folder, read_manifest(folder), skipped=False, reasons=tuple(reasons))


def _build_into(work: Path, model, model_dir: Path, model_fp: str, spec: BuildSpec, graph: VisionGraph | None,
                bar: Steps) -> None:
    engines: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    if graph is not None:
        checks["vision"], engines["vision"] = _build_vision(work, model, spec, graph, bar)
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
    if spec.precision != "fp32":
        bar.step(f"quantizing the decoder to {spec.precision}")
        quantization = quantize_decoder(fp32, work / DECODER_FILE) if spec.precision == "int8" else \
            quantize_decoder_int4(fp32, work / DECODER_FILE, spec.int4)
        for name in graph_files(work, fp32.name):
            (work / name).unlink()
        check_graph(work / DECODER_FILE)
        quantization["check"] = check_decoder(model.decoder, work / DECODER_FILE, spec.block_size)
        bar.done()
    engines["decoder"] = {"file": DECODER_FILE, "runtime": "onnxruntime", "precision": spec.precision,
                          "quantization": quantization, "embedding": "host (the graph starts at inputs_embeds)",
                          **graph_io(work / DECODER_FILE)}
    bar.step("writing the manifest")
    write_manifest(work, _manifest(work, model, model_dir, model_fp, spec, engines, checks))
    bar.done()


def _build_vision(work: Path, model, spec: BuildSpec, graph: VisionGraph, bar: Steps) -> tuple[dict, dict]:
    """Export and check the vision graph, and quantize it to int8 when the spec asks; returns its
    check and its manifest entry."""
    fp32 = work / (VISION_FILE if spec.vision_precision == "fp32" else "vision.fp32.onnx")
    bar.step("exporting the vision engine")
    example = model.adapter.process_image(sample_images()[0]).tensors
    _run_export(lambda: export_vision(graph, example, fp32, spec.opset), fp32)
    bar.done()
    bar.step("checking the vision engine")
    check_graph(fp32)
    check = check_vision(graph, model.adapter, fp32)
    _require_close("vision", check["max_abs_diff"], 1.0, fp32)
    bar.done()
    quantization = None
    if spec.vision_precision == "int8":
        bar.step("quantizing the vision engine to int8")
        quantization = quantize_vision(fp32, work / VISION_FILE, graph.fused_attention())
        for name in graph_files(work, fp32.name):
            (work / name).unlink()
        check_graph(work / VISION_FILE)
        quantization["check"] = check_vision(graph, model.adapter, work / VISION_FILE)
        cosine = quantization["check"]["cosine"]
        if not cosine >= VISION_INT8_MIN_COSINE:
            raise EngineBuildError(f"the int8 vision graph's embeddings have a mean cosine similarity of {cosine:.3g} "
                                   f"to torch's (limit {VISION_INT8_MIN_COSINE})", artifact=str(work / VISION_FILE))
        bar.done()
    entry = {"file": VISION_FILE, "runtime": "onnxruntime", "family_graph": type(graph).__name__,
             "precision": spec.vision_precision, "quantization": quantization, **graph_io(work / VISION_FILE)}
    return check, entry


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
