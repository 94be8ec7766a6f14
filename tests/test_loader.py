"""The loader's errors: each names what is wrong and how to fix it."""

from __future__ import annotations

import json
import shutil

import pytest

from edgeinfer.errors import ModelLoadError, UnsupportedArchitectureError
from edgeinfer.models import supported_architectures
from edgeinfer.models.loader import load_model


def copy_of(checkpoint, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(checkpoint("smolvlm"), target)
    return target


def test_every_family_is_registered():
    assert set(supported_architectures()) == {
        "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration", "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration", "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
        "Qwen3VLForConditionalGeneration", "InternVLForConditionalGeneration", "Gemma3ForConditionalGeneration",
        "Gemma4ForConditionalGeneration"}


def test_unknown_architecture_lists_the_supported_ones(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MysteryForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as caught:
        load_model(path)
    assert "MysteryForConditionalGeneration" in str(caught.value)
    assert "SmolVLMForConditionalGeneration" in str(caught.value)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"])
def test_a_missing_file_is_named(checkpoint, tmp_path, missing):
    path = copy_of(checkpoint, tmp_path)
    (path / missing).unlink()
    with pytest.raises(ModelLoadError) as caught:
        load_model(path)
    assert missing in str(caught.value)


def test_remote_code_needs_the_explicit_flag(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as caught:
        load_model(path)
    assert "--trust-remote-code" in str(caught.value)


def test_truncated_weights_are_a_load_error(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_of(checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    dropped = next(k for k in tensors if "layers.1.mlp.down_proj" in k)
    del tensors[dropped]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as caught:
        load_model(path)
    assert "down_proj" in str(caught.value)
