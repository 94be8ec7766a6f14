"""The engines folder: its root, the typed manifest and its errors, the rebuild command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeinfer.artifacts import (
    ENGINES_ENV,
    MANIFEST,
    Expected,
    ManifestError,
    engine_dir,
    engines_root,
    folder_problems,
    read_manifest,
    rebuild_command,
    write_manifest,
)
from edgeinfer.errors import EngineBuildError


def manifest_document(**changes) -> dict:
    document = {"schema": 1, "backend": "onnxruntime", "model": "m", "model_dir": "/models/m", "profile": "cpu",
                "precision": "int8", "opset": 18, "export_revision": 4,
                "fingerprint": {"model": "a" * 64, "profile": "b" * 16, "onnx": {}, "tensorrt": None, "sm": None},
                "files": {}, "engines": {"decoder": {"file": "decoder.onnx", "runtime": "onnxruntime",
                                                     "precision": "int8"}}}
    return document | changes


def test_the_root_is_a_parameter_then_the_environment_then_engines(monkeypatch, tmp_path):
    monkeypatch.delenv(ENGINES_ENV, raising=False)
    assert engines_root() == Path("engines")
    monkeypatch.setenv(ENGINES_ENV, str(tmp_path))
    assert engines_root() == tmp_path
    assert engine_dir(tmp_path / "x", "m", "cpu") == tmp_path / "x" / "m" / "cpu"


def test_the_manifest_is_typed_and_reads_back_what_was_written(tmp_path):
    written = write_manifest(tmp_path, manifest_document())
    manifest = read_manifest(tmp_path)
    assert manifest == written and manifest.to_json() == json.loads((tmp_path / MANIFEST).read_text())
    assert (manifest.profile, manifest.precision, manifest.fingerprint.model) == ("cpu", "int8", "a" * 64)
    assert manifest.engine("decoder").file == "decoder.onnx" and manifest.tensorrt is None
    assert read_manifest(tmp_path / "absent") is None


@pytest.mark.parametrize(("change", "field"), [
    ({"fingerprint": {"model": 3}}, "fingerprint.model"),
    ({"precision": ["int8"]}, "precision"),
    ({"engines": {"decoder": "decoder.onnx"}}, "engines.decoder"),
    ({"tensorrt": {"fingerprint": {}, "engines": {"decoder": {"plan_file": "d.plan", "shapes": {"x": {
        "min": [1], "opt": [1], "max": ["big"]}}}}}}, "tensorrt.engines.decoder.shapes.x"),
])
def test_a_wrong_field_is_an_error_naming_the_file_and_the_field(tmp_path, change, field):
    (tmp_path / MANIFEST).write_text(json.dumps(manifest_document(**change)))
    with pytest.raises(ManifestError) as error:
        read_manifest(tmp_path)
    assert error.value.field == field and str(tmp_path / MANIFEST) in str(error.value)
    assert isinstance(error.value, EngineBuildError)  # the CLI maps it like any build error
    problems = folder_problems(tmp_path, Expected("cpu", "b" * 16))
    assert len(problems) == 1 and "corrupt manifest" in problems[0] and field in problems[0]


def test_not_json_and_missing_are_named(tmp_path):
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ManifestError, match="corrupt manifest"):
        read_manifest(tmp_path)
    assert folder_problems(tmp_path / "none", Expected("cpu", None)) == [
        f"{tmp_path / 'none' / MANIFEST}: missing (not built)"]


def test_the_rebuild_command_rebuilds_what_was_built(tmp_path):
    onnx = write_manifest(tmp_path, manifest_document())
    assert rebuild_command(onnx) == ("edgeinfer build --backend onnxruntime --model /models/m --profile cpu "
                                     "--precision int8")
    fp32 = write_manifest(tmp_path, manifest_document(precision="fp32", profile="custom"))
    assert rebuild_command(fp32) == "edgeinfer build --backend onnxruntime --model /models/m"
    options = {"block_size": 32, "symmetric": False, "accuracy_level": 4, "format": "matmulnbits", "head": "int4"}
    document = manifest_document(precision="int4")
    document["engines"]["decoder"]["quantization"] = {"options": options}
    assert rebuild_command(write_manifest(tmp_path, document)) == (
        "edgeinfer build --backend onnxruntime --model /models/m --profile cpu --precision int4 --int4-block-size 32 "
        "--int4-accuracy-level 4 --int4-format matmulnbits --int4-head int4 --int4-asymmetric")
    plans = write_manifest(tmp_path, manifest_document(fingerprint={"model": "a" * 64, "tensorrt": "10.3.0"}))
    assert rebuild_command(plans) == "edgeinfer build --backend tensorrt --model /models/m --profile cpu"


def test_a_checkpoint_is_hashed_once_per_machine_and_again_after_a_change(monkeypatch, tmp_path):
    """The checkpoint's digest is remembered in the user's cache across processes (a new process
    is a cleared in-process cache here), never in the checkpoint's folder; a rewrite of a weight
    file changes the fingerprint."""
    from edgeinfer import artifacts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    first = artifacts.checkpoint_fingerprint(model)
    remembered = json.loads(artifacts.checkpoint_digests().read_text())
    assert str(weights.resolve()) in remembered and not (model / artifacts.HASH_CACHE).exists()

    reads = []
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: reads.append(self.name) or real_open(self, *a, **k))
    artifacts._checkpoint_digest.cache_clear()  # as a new process would start
    assert artifacts.checkpoint_fingerprint(model) == first
    assert "model.safetensors" not in reads

    weights.write_bytes(b"b" * 4097)  # another size: two writes may share a coarse mtime
    assert artifacts.checkpoint_fingerprint(model) != first
