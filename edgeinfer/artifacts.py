"""The built-engines folder: where it is, what its manifest says, and whether a build still fits.

Layout, under a root that is always a parameter (``None``: ``$EDGEINFER_ENGINES``, else
``./engines``)::

    <root>/<model>/<profile>/vision.onnx decoder.onnx [vision.plan decoder.plan] manifest.json
    <root>/<model>/<profile>/.sha256-cache.json       digests remembered by size and mtime
    <root>/timing-cache/                              TensorRT's timing caches

``manifest.json`` is read once into a frozen :class:`Manifest`; a file that is not JSON or
whose fields have the wrong type is a :class:`ManifestError` naming the file and the field.
:func:`stale_reasons` is the one check of a build against what this machine, checkpoint
and profile need; the backends, the backend registry and ``edgeinfer doctor`` all call it.

This module sits below the backends: it imports none of them, nor the engine.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.errors import EngineBuildError

ENGINES_ENV = "EDGEINFER_ENGINES"
DEFAULT_ROOT = "engines"
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
TENSORRT_SCHEMA = 1  # of the manifest's ``tensorrt`` section
HASH_CACHE = ".sha256-cache.json"  # beside built engines: {file: [size, mtime_ns, sha256]}
# Checkpoint files the built graphs are made from (the manifest's ``fingerprint.model``).
CHECKPOINT_CONFIG = "config.json"
WEIGHTS_GLOB = "*.safetensors"
# Further checkpoint files the KV of a prompt depends on: tokenizer, processor, chat template.
SIDE_SUFFIXES = (".json", ".jinja")

_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


# --------------------------------------------------------------------------- layout


def engines_root(root: str | Path | None = None) -> Path:
    """Where built engines live: ``root``, else ``$EDGEINFER_ENGINES``, else ``./engines``."""
    return Path(root if root is not None else (os.environ.get(ENGINES_ENV) or DEFAULT_ROOT))


def engine_dir(root: str | Path | None, model_name: str, profile_name: str) -> Path:
    """The folder of one model's engines built for one profile."""
    return engines_root(root) / model_name / profile_name


def manifest_paths(root: str | Path | None) -> list[Path]:
    """Every ``manifest.json`` under ``root``, sorted."""
    return sorted(engines_root(root).glob(f"*/*/{MANIFEST}"))


def build_command(backend: str | None, model_dir: str | Path, profile: str, precision: str | None = None) -> str:
    """The ``edgeinfer build`` command that (re)builds a folder. ``profile`` ``custom`` (an engine
    configured without a profile) adds no ``--profile``; precision ``fp32`` is the default."""
    parts = ["edgeinfer build"]
    if backend:
        parts.append(f"--backend {backend}")
    parts.append(f"--model {model_dir}")
    if profile != "custom":
        parts.append(f"--profile {profile}")
    if precision and precision != "fp32":
        parts.append(f"--precision {precision}")
    return " ".join(parts)


# --------------------------------------------------------------------------- hashing


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def file_sha256(path: Path, *, remember: bool = False, store: Path | None = None) -> str:
    """sha256 of a file. With ``remember``, the digest is kept under the file's size and
    modification time, so multi-GB files are read once rather than at every start; any write
    to the file invalidates it. The digests live in ``store`` (keyed by the file's absolute
    path), else in the file's own folder (``.sha256-cache.json``, keyed by name: engine folders)."""
    stat = path.stat()
    key = [stat.st_size, stat.st_mtime_ns]
    name = path.name if store is None else str(path.resolve())
    store = path.parent / HASH_CACHE if store is None else store
    entries: dict[str, Any] = {}
    if remember:
        loaded = _read_json(store)
        entries = loaded if isinstance(loaded, dict) else {}
        hit = entries.get(name)
        if isinstance(hit, list) and len(hit) == 3 and hit[:2] == key:
            return hit[2]
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    if remember:
        entries[name] = [*key, digest.hexdigest()]
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            temporary = store.with_name(f"{store.name}.{os.getpid()}.tmp")
            temporary.write_text(json.dumps(entries))
            temporary.replace(store)
        except OSError:
            pass  # a read-only folder: hash again next time
    return digest.hexdigest()


def changed_files(folder: Path, digests: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name, "missing" | "changed") for each file of ``digests`` that is absent from ``folder``
    or whose sha256 differs."""
    out = []
    for name, digest in digests.items():
        path = folder / name
        if not path.is_file():
            out.append((name, "missing"))
        elif file_sha256(path, remember=True) != digest:
            out.append((name, "changed"))
    return out


def file_problems(folder: Path, digests: Mapping[str, str]) -> list[str]:
    """:func:`changed_files` as reasons: one line a file, naming its path."""
    return [f"{folder / name}: missing" if what == "missing"
            else f"{folder / name}: corrupt or changed (sha256 differs from the manifest)"
            for name, what in changed_files(folder, digests)]


# --------------------------------------------------------------------------- the checkpoint


def cache_home() -> Path:
    """This machine's cache folder for edgeinfer (checkpoint digests, the KV disk tier's default,
    kernel tiles): ``$XDG_CACHE_HOME/edgeinfer``, else ``~/.cache/edgeinfer``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeinfer"


def checkpoint_digests() -> Path:
    """Where checkpoint files' digests are remembered across processes (never inside the
    checkpoint's folder, which may be read-only or shared): under :func:`cache_home`."""
    return cache_home() / "checkpoint-sha256.json"


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """The checkpoint's identity: sha256 over the names and contents of ``config.json`` and the
    ``*.safetensors`` weights (the manifest's ``fingerprint.model``). Each file is read once
    per machine while it keeps its size and modification time (:func:`checkpoint_digests`),
    so a start after the first costs no pass over multi-GB weights."""
    folder = Path(model_dir).resolve()
    names = [CHECKPOINT_CONFIG, *sorted(p.name for p in folder.glob(WEIGHTS_GLOB))]
    return _checkpoint_digest(str(folder), _stats(folder, names))


def _stats(folder: Path, names: Iterable[str]) -> tuple[tuple[str, int, int], ...]:
    return tuple((n, (folder / n).stat().st_size, (folder / n).stat().st_mtime_ns)
                 for n in names if (folder / n).is_file())


@functools.lru_cache(maxsize=32)
def _checkpoint_digest(folder: str, stats: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in stats:
        digest.update(name.encode())
        digest.update(file_sha256(Path(folder) / name, remember=True, store=checkpoint_digests()).encode())
    return digest.hexdigest()


def prefix_cache_root(model_dir: str | Path, runs: str) -> bytes:
    """The root key of a prefix-cache chain (16 bytes): the checkpoint's identity, the files
    that turn a prompt into tokens and pixels (tokenizer, processor, chat template), and
    ``runs``, what runs the checkpoint (family, dtype, backend, build). Two engines share
    KV blocks only where all of these are equal."""
    folder = Path(model_dir).resolve()
    h = hashlib.blake2b(digest_size=16)
    h.update(checkpoint_fingerprint(folder).encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SIDE_SUFFIXES
                       and p.name != CHECKPOINT_CONFIG and not p.name.startswith(".")):
        h.update(f"{path.name}:".encode())
        h.update(path.read_bytes())
    h.update(runs.encode())
    return h.digest()


# --------------------------------------------------------------------------- the manifest


class ManifestError(EngineBuildError):
    """A ``manifest.json`` that is not JSON, or a field of it of the wrong type."""

    def __init__(self, path: Path, reason: str, field: str | None = None) -> None:
        what = f"field {field!r} {reason}" if field else reason
        super().__init__(f"corrupt manifest ({what})", artifact=str(path),
                         fix=f"rebuild it, or remove {path.parent}")
        self.path = path
        self.field = field


class _Fields:
    """Typed reads of one JSON object of a manifest; a wrong type names the field."""

    def __init__(self, path: Path, data: Any, prefix: str = "") -> None:
        self.path, self.prefix = path, prefix
        if not isinstance(data, Mapping):
            raise ManifestError(path, f"must be an object, got {type(data).__name__}", prefix or None)
        self.data = data

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, kinds: type | tuple[type, ...], *, required: bool = False) -> Any:
        value = self.data.get(key)
        if value is None:
            if required:
                raise ManifestError(self.path, "is missing", self._name(key))
            return None
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in _tuple(kinds):
            raise ManifestError(self.path, f"must be {_kind_names(kinds)}, got {type(value).__name__}",
                                self._name(key))
        return value

    def section(self, key: str, *, required: bool = False) -> "_Fields | None":
        value = self.data.get(key)
        if value is None and not required:
            return None
        return _Fields(self.path, value, self._name(key))

    def digests(self, key: str) -> Mapping[str, str]:
        value = self.section(key)
        if value is None:
            return _EMPTY
        for name, digest in value.data.items():
            if not isinstance(digest, str):
                raise ManifestError(self.path, f"must map file names to sha256 strings, {name!r} does not",
                                    self._name(key))
        return types.MappingProxyType(dict(value.data))


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    return " or ".join({str: "a string", int: "an integer", float: "a number", dict: "an object",
                        list: "a list", bool: "true or false"}.get(k, k.__name__) for k in _tuple(kinds))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The manifest's ``fingerprint``: what the graphs were built from. ``tensorrt``, ``sm`` and
    ``gpu`` repeat the TensorRT build's target (None where no plan was built)."""

    model: str | None
    profile: str | None
    onnx: Mapping[str, str]
    tensorrt: str | None = None
    sm: str | None = None
    gpu: str | None = None


@dataclass(frozen=True, slots=True)
class GraphEntry:
    """One engine of the ONNX build (``engines.vision`` / ``engines.decoder``)."""

    runtime: str  # "onnxruntime", or "torch" for a tower with no ONNX graph
    file: str | None
    precision: str | None
    document: Mapping[str, Any]  # the entry as written (graph inputs, outputs, quantization, reason)


@dataclass(frozen=True, slots=True)
class ShapeRange:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One TensorRT engine of the build (``tensorrt.engines.<name>``)."""

    plan_file: str
    precision: str
    flags: tuple[str, ...]
    workspace_bytes: int
    dla_core: int | None
    shapes: Mapping[str, ShapeRange]
    document: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class TensorRTFingerprint:
    """What a serialized TensorRT engine is tied to; any difference means a rebuild."""

    tensorrt: str
    gpu: str
    sm: str
    profile: str | None
    onnx: Mapping[str, str]
    pool_blocks: int  # the KV pool's length is an engine input dim (memory.* is not in the profile hash)

    def to_dict(self) -> dict[str, Any]:
        return {"tensorrt": self.tensorrt, "gpu": self.gpu, "sm": self.sm, "profile": self.profile,
                "onnx": dict(self.onnx), "pool_blocks": self.pool_blocks}


@dataclass(frozen=True, slots=True)
class TensorRTSection:
    schema: int
    fingerprint: TensorRTFingerprint
    plans: Mapping[str, str]  # plan file -> sha256
    engines: Mapping[str, PlanEntry]
    build_seconds: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Manifest:
    """``manifest.json`` of one engine folder, validated at read. ``document`` is the JSON as
    read (a read-only view), for reports; :meth:`to_json` gives a copy to write back."""

    path: Path
    schema: int | None
    backend: str | None
    model: str | None
    model_dir: str | None
    profile: str
    precision: str | None
    opset: int | None
    export_revision: int | None
    fingerprint: Fingerprint
    files: Mapping[str, str]
    engines: Mapping[str, GraphEntry]
    tensorrt: TensorRTSection | None
    document: Mapping[str, Any]

    @property
    def folder(self) -> Path:
        return self.path.parent

    def to_json(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.document))

    def engine(self, name: str) -> GraphEntry:
        """``engines.<name>``; its absence is a corrupt manifest."""
        entry = self.engines.get(name)
        if entry is None:
            raise ManifestError(self.path, "is missing", f"engines.{name}")
        return entry


def parse_manifest(data: Any, path: Path) -> Manifest:
    """A :class:`Manifest` of the JSON ``data`` read from ``path``; a wrong field is a ManifestError."""
    top = _Fields(path, data)
    fp = top.section("fingerprint", required=True)
    fingerprint = Fingerprint(fp.get("model", str), fp.get("profile", str), fp.digests("onnx"),
                              fp.get("tensorrt", str), fp.get("sm", str), fp.get("gpu", str))
    engines = {}
    section = top.section("engines")
    for name in (section.data if section else {}):
        entry = section.section(name, required=True)
        engines[name] = GraphEntry(entry.get("runtime", str) or "onnxruntime", entry.get("file", str),
                                   entry.get("precision", str), types.MappingProxyType(dict(entry.data)))
    frozen = types.MappingProxyType(copy.deepcopy(dict(data)))
    return Manifest(
        path=path, schema=top.get("schema", int), backend=top.get("backend", str), model=top.get("model", str),
        model_dir=top.get("model_dir", str), profile=top.get("profile", str) or path.parent.name,
        precision=top.get("precision", str), opset=top.get("opset", int),
        export_revision=top.get("export_revision", int), fingerprint=fingerprint,
        files=top.digests("files"), engines=types.MappingProxyType(engines),
        tensorrt=_tensorrt_section(top.section("tensorrt")), document=frozen)


def _tensorrt_section(section: _Fields | None) -> TensorRTSection | None:
    if section is None:
        return None
    fp = section.section("fingerprint", required=True)
    fingerprint = TensorRTFingerprint(fp.get("tensorrt", str) or "", fp.get("gpu", str) or "",
                                      fp.get("sm", str) or "", fp.get("profile", str), fp.digests("onnx"),
                                      fp.get("pool_blocks", int) or 0)
    engines = {}
    listed = section.section("engines")
    for name in (listed.data if listed else {}):
        entry = listed.section(name, required=True)
        engines[name] = PlanEntry(entry.get("plan_file", str, required=True), entry.get("precision", str) or "",
                                  tuple(entry.get("flags", list) or ()), entry.get("workspace_bytes", int) or 0,
                                  entry.get("dla_core", int), _shapes(entry),
                                  types.MappingProxyType(dict(entry.data)))
    seconds = section.get("build_seconds", dict) or {}
    return TensorRTSection(section.get("schema", int) or 0, fingerprint, section.digests("plans"),
                           types.MappingProxyType(engines), types.MappingProxyType(dict(seconds)))


def _shapes(entry: _Fields) -> Mapping[str, ShapeRange]:
    shapes = entry.section("shapes")
    out = {}
    for name in (shapes.data if shapes else {}):
        triple = shapes.section(name, required=True)
        try:
            out[name] = ShapeRange(*(tuple(int(d) for d in triple.get(k, list, required=True))
                                     for k in ("min", "opt", "max")))
        except (TypeError, ValueError):
            raise ManifestError(entry.path, "must hold lists of integers", f"{shapes.prefix}.{name}") from None
    return types.MappingProxyType(out)


def read_manifest(folder: Path) -> Manifest | None:
    """The manifest of an engine folder; None when absent. A corrupt one is a ManifestError naming it."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ManifestError(path, str(exc)) from None
    return parse_manifest(data, path)


def write_manifest(folder: Path, document: Mapping[str, Any]) -> Manifest:
    """Replace ``manifest.json`` whole (a reader never sees half of one); the manifest as read back."""
    parsed = parse_manifest(document, folder / MANIFEST)  # never write what could not be read
    temporary = folder / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, folder / MANIFEST)
    return parsed


def rebuild_command(manifest: Manifest) -> str:
    """The command that rebuilds ``manifest``'s folder as it was built: TensorRT where plans were
    built, else the ONNX build at its precision."""
    tensorrt = manifest.tensorrt is not None or manifest.fingerprint.tensorrt is not None
    backend = "tensorrt" if tensorrt else manifest.backend
    precision = manifest.precision if backend == "onnxruntime" else None
    command = build_command(backend, manifest.model_dir or manifest.model or manifest.folder.parent.name,
                            manifest.profile, precision)
    if precision != "int4":
        return command
    # Every int4 option the build recorded, spelled out: the defaults of a later edgeinfer may differ.
    decoder = manifest.engines.get("decoder")
    options = ((decoder.document.get("quantization") or {}).get("options") or {}) if decoder else {}
    return " ".join((command, *int4_flags(options)))


def int4_flags(options: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """``edgeinfer build`` arguments of int4 ``options`` (``Int4Options.to_json()`` names; None: not
    given), leaving out those equal to ``defaults``: valued options first, then the symmetry switch."""
    given = {k: v for k, v in options.items() if v is not None and (defaults is None or defaults.get(k) != v)}
    flags = [part for name, value in given.items() if not isinstance(value, bool)
             for part in (f"--int4-{name.replace('_', '-')}", str(value))]
    if "symmetric" in given:
        flags.append("--int4-symmetric" if given["symmetric"] else "--int4-asymmetric")
    return flags


# --------------------------------------------------------------------------- staleness


@dataclass(frozen=True, slots=True)
class GraphFormat:
    """What the ONNX graphs of this edgeinfer are: its export revision and opset."""

    export_revision: int
    opset: int


@dataclass(frozen=True, slots=True)
class TensorRTTarget:
    """The machine TensorRT plans must have been built for. ``gpu``, ``sm`` and ``pool_blocks``
    None: not known here, not compared. ``required``: the plans must exist (a load); otherwise
    only a TensorRT build the manifest records is compared (doctor)."""

    tensorrt: str | None  # None: TensorRT is not installed here
    gpu: str | None = None
    sm: str | None = None
    pool_blocks: int | None = None
    required: bool = True


@dataclass(frozen=True, slots=True)
class Expected:
    """What a build must match to be used. ``profile`` and ``profile_fingerprint`` are always
    compared (None: an engine configured without a profile); the other fields only when set."""

    profile: str
    profile_fingerprint: str | None
    checkpoint: str | None = None  # checkpoint_fingerprint() of the checkpoint to run
    precision: str | None = None  # None: whichever precision was built
    graphs: GraphFormat | None = None
    tensorrt: TensorRTTarget | None = None


def stale_reasons(manifest: Manifest, expected: Expected) -> list[str]:
    """Why the build of ``manifest`` does not fit ``expected``; [] when it does. Reasons about the
    build name no path (the caller names the folder), reasons about a file name the file."""
    reasons = _graph_reasons(manifest, expected)
    if expected.tensorrt is not None:
        reasons += _tensorrt_reasons(manifest, expected.tensorrt)
    return reasons


def _graph_reasons(manifest: Manifest, expected: Expected) -> list[str]:
    reasons = []
    graphs = expected.graphs
    if graphs is not None:
        if manifest.schema != MANIFEST_SCHEMA or manifest.backend != "onnxruntime":
            reasons.append(f"not an edgeinfer engine manifest of schema {MANIFEST_SCHEMA} "
                           f"(schema {manifest.schema}, backend {manifest.backend})")
        if manifest.export_revision != graphs.export_revision:
            reasons.append(f"graphs of export revision {manifest.export_revision}, this edgeinfer exports "
                           f"revision {graphs.export_revision}")
        if manifest.opset != graphs.opset:
            reasons.append(f"opset {manifest.opset} -> {graphs.opset}")
    if expected.checkpoint is not None and manifest.fingerprint.model != expected.checkpoint:
        reasons.append("built from other weights or config (model fingerprint changed)")
    plans = manifest.tensorrt.fingerprint.profile if manifest.tensorrt and expected.tensorrt else None
    if manifest.profile != expected.profile or manifest.fingerprint.profile != expected.profile_fingerprint \
            or plans not in (None, expected.profile_fingerprint):
        reasons.append(f"profile {manifest.profile!r} changed since the build")
    if expected.precision is not None and manifest.precision != expected.precision:
        reasons.append(f"precision {manifest.precision} -> {expected.precision}")
    onnx_files = {**manifest.fingerprint.onnx, **manifest.files}
    return reasons + file_problems(manifest.folder, onnx_files)


def _tensorrt_reasons(manifest: Manifest, target: TensorRTTarget) -> list[str]:
    section = manifest.tensorrt
    if section is None:
        if target.required:
            return ["no TensorRT engines built"]
        built = manifest.fingerprint
        if built.tensorrt is None:
            return []  # an ONNX build only: nothing of TensorRT to compare
        return _target_reasons(built.tensorrt, built.gpu, built.sm, target)
    if section.schema != TENSORRT_SCHEMA:
        return [f"TensorRT section of schema {section.schema}, expected {TENSORRT_SCHEMA}"]
    built = section.fingerprint
    reasons = _target_reasons(built.tensorrt, built.gpu, built.sm, target)
    if dict(built.onnx) != dict(manifest.fingerprint.onnx):
        reasons.append("built from other ONNX graphs (ONNX hash changed)")
    if target.pool_blocks is not None and built.pool_blocks != target.pool_blocks:
        reasons.append(f"built for a KV pool of {built.pool_blocks} blocks, this one has {target.pool_blocks}")
    reasons += file_problems(manifest.folder, section.plans)
    if not section.plans:
        reasons.append("the manifest lists no TensorRT plan")
    return reasons


def _target_reasons(tensorrt: str | None, gpu: str | None, sm: str | None, target: TensorRTTarget) -> list[str]:
    reasons = []
    if tensorrt != target.tensorrt:
        reasons.append(f"built with TensorRT {tensorrt}, this machine has {target.tensorrt or 'none'}")
    for label, built, here in (("GPU", gpu, target.gpu), ("GPU SM", sm, target.sm)):
        if here is not None and built != here:
            reasons.append(f"built with {label} {built}, this machine has {here}")
    return reasons


def folder_problems(folder: Path, expected: Expected) -> list[str]:
    """[] when ``folder`` holds a build that fits ``expected``; otherwise what is missing,
    corrupt or stale, the missing or corrupt manifest named by its path."""
    try:
        manifest = read_manifest(folder)
    except ManifestError as exc:
        return [str(exc)]
    if manifest is None:
        return [f"{folder / MANIFEST}: missing (not built)"]
    return stale_reasons(manifest, expected)
