"""``edgeinfer quantize``: compressed-tensors output that transformers loads, AWQ's scale search, the CLI.

Tiny random checkpoints (hidden 64), so group sizes are 16 or 32 here. The demo model's accuracy
after quantization is measured by ``scripts/eval_demo.py`` (see docs/quantize.md), not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from edgeinfer.cli.main import app
from edgeinfer.progress import NoSteps
from edgeinfer.quant import awq
from edgeinfer.quant.compress import (
    REPORT_NAME,
    Method,
    QuantizeOptions,
    QuantSpec,
    fake_quantized,
    language_linears,
)
from edgeinfer.quant.quantize import quantize_checkpoint

runner = CliRunner()


def load(folder: Path, decompress: bool = True):
    """A checkpoint in transformers; a quantized one decompressed by compressed-tensors (its packed
    layers become dense ``weight`` again) unless ``decompress`` is False."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    if decompress and getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.compressor.decompress_model(model)
    return model


def reference(folder: Path, options: QuantizeOptions):
    """The source model as ``quantize`` transforms it before packing, computed here in memory."""
    model = load(folder, decompress=False)
    if options.method is Method.awq:
        awq.smooth_model(model, options, NoSteps())
    return model


# Symmetric only: compressed-tensors 0.20.1 builds the empty model transformers loads into with
# unpacked zero points, so it refuses the packed ones its own compressor writes (and vLLM reads);
# the asymmetric files are checked against compressed-tensors' decompressor below.
CASES = [
    # family, method, spec
    ("llava", Method.rtn, QuantSpec(4, 16, True, lm_head_bits=8)),
    ("qwen2_vl", Method.rtn, QuantSpec(8, None, True)),
    ("gemma3", Method.awq, QuantSpec(4, 32, True)),
    ("qwen2_vl", Method.rtn, QuantSpec(4, 32, True, lm_head_bits=4)),
]


CASE_IDS = [f"{family}-{method.value}-w{spec.bits}" + (f"-h{spec.lm_head_bits}" if spec.lm_head_bits else "")
            for family, method, spec in CASES]


@pytest.mark.parametrize("family,method,spec", CASES, ids=CASE_IDS)
def test_output_loads_in_transformers_and_equals_our_fake_quantization(checkpoint, tmp_path, family, method, spec):
    source = checkpoint(family)
    options = QuantizeOptions(source, tmp_path / "q", spec, method, samples=2)
    report = quantize_checkpoint(options)
    expected = reference(source, options)
    loaded = load(options.out)

    quantized = language_linears(expected)
    head = spec.lm_head_bits is not None
    assert {layer.name for layer in report.layers} == set(quantized) | ({"lm_head"} if head else set())
    loaded_params = dict(loaded.named_parameters())
    for name, param in expected.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module in quantized and name.endswith(".weight"):
            want = fake_quantized(param.detach(), spec.weight_args())
        elif module == "lm_head" and head:
            want = fake_quantized(param.detach(), spec.lm_head_args())
        else:
            want = param.detach()  # vision tower, projector, embeddings, norms: as they were (AWQ: scaled)
        assert torch.equal(loaded_params[name], want), name
    if head:
        assert not torch.equal(loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight)

    config = json.loads((options.out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    groups = {tuple(group["targets"]): group["weights"] for group in config["config_groups"].values()}
    weights = groups[("Linear",)]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (spec.bits, spec.group_size,
                                                                                    spec.symmetric)
    assert weights["strategy"] == ("channel" if spec.group_size is None else "group")
    assert ("lm_head" in config["ignore"]) is not head
    if head:
        stored = groups[("lm_head",)]
        assert (stored["num_bits"], stored["strategy"], stored["group_size"], stored["symmetric"]) == (
            (8, "channel", None, True) if spec.lm_head_bits == 8 else (4, "group", spec.group_size, True))
    assert any("vision" in name or "visual" in name for name in config["ignore"])


def test_an_int8_lm_head_is_untied_from_the_embeddings_it_shared(tmp_path):
    from edgeinfer.demo import DEMO_MODEL_DIR

    source = load(DEMO_MODEL_DIR, decompress=False)
    assert source.get_output_embeddings().weight is source.get_input_embeddings().weight
    spec = QuantSpec(4, 128, lm_head_bits=8)
    quantize_checkpoint(QuantizeOptions(Path(DEMO_MODEL_DIR), tmp_path / "q", spec))
    loaded = load(tmp_path / "q")
    assert torch.equal(loaded.get_input_embeddings().weight, source.get_input_embeddings().weight)
    assert torch.equal(loaded.get_output_embeddings().weight,
                       fake_quantized(source.get_output_embeddings().weight.detach(), spec.lm_head_args()))


@pytest.mark.parametrize("spec", [QuantSpec(4, 32, False), QuantSpec(8, None, False)], ids=["w4-g32", "w8-channel"])
def test_asymmetric_files_hold_packed_zero_points_that_decompress_to_our_fake_quantization(checkpoint, tmp_path,
                                                                                           spec):
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    out = tmp_path / "q"
    quantize_checkpoint(QuantizeOptions(checkpoint("llava"), out, spec))
    tensors = load_file(out / "model.safetensors")
    source = load(checkpoint("llava"), decompress=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=spec.weight_args())
    pack = 32 // spec.bits
    for name, linear in language_linears(source).items():
        key = name.replace("model.language_model.", "language_model.model.")  # LLaVA's on-disk spelling
        stored = {part: tensors[f"{key}.{part}"] for part in ("weight_packed", "weight_scale", "weight_zero_point",
                                                                "weight_shape")}
        rows, columns = linear.weight.shape
        assert stored["weight_packed"].shape == (rows, columns // pack) and stored["weight_packed"].dtype == torch.int32
        assert stored["weight_zero_point"].shape == (rows // pack, stored["weight_scale"].shape[1])
        dense = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
        assert torch.equal(dense, fake_quantized(linear.weight.detach(), spec.weight_args())), name
    for name in ("tokenizer.json", "chat_template.jinja", "processor_config.json"):
        assert (out / name).is_file(), name


def test_compressed_load_generates_the_tokens_of_the_dequantized_load(checkpoint, tmp_path):
    """transformers' default load keeps packed layers and decompresses them at the first forward."""
    from transformers import AutoProcessor

    out = tmp_path / "q"
    quantize_checkpoint(QuantizeOptions(checkpoint("llava"), out, QuantSpec(4, 16)))
    processor = AutoProcessor.from_pretrained(out)
    image = awq.calibration_samples(None, 1)[0][0]
    inputs = awq.model_inputs(processor, image, "What color is the shape?")
    tokens = [load(out, decompress).generate(**inputs, max_new_tokens=6, do_sample=False)
              for decompress in (True, False)]
    assert torch.equal(tokens[0], tokens[1])


@pytest.mark.parametrize("family,method,with_image,lm_head_bits",
                         [("qwen2_vl", Method.rtn, True, None), ("llava", Method.awq, False, None),
                          ("qwen2_vl", Method.rtn, False, 8), ("qwen2_vl", Method.rtn, False, 4)])
def test_edgeinfer_loads_its_own_output_with_transformers_tokens(checkpoint, tmp_path, family, method, with_image,
                                                                 lm_head_bits):
    """The round trip a user makes: ``edgeinfer quantize``, then serve the folder with edgeinfer;
    32 greedy tokens equal transformers' on the same folder (text, and one image where the
    test can build transformers' image inputs). With a quantized ``lm_head`` the head's own config
    group (int8 per channel, or 4-bit groups) must win over the ``Linear`` group that also covers it."""
    from tests.conftest import noise_image
    from tests.test_quant_load import ours, transformers_tokens

    out = tmp_path / "q"
    spec = QuantSpec(4, 32, lm_head_bits=lm_head_bits)
    quantize_checkpoint(QuantizeOptions(checkpoint(family), out, spec, method=method, samples=2))
    model = load(out)
    for images in ([], [noise_image(64, 48, seed=3)])[:1 + with_image]:
        engine, prompt_ids, tokens = ours(out, images)
        assert engine.model.quantized is not None and engine.model.quantized.layers
        assert len(set(tokens)) >= 8
        assert tokens == transformers_tokens(model, family, engine, prompt_ids, images)


def test_awq_without_the_processor_packages_is_a_typed_refusal(checkpoint, tmp_path):
    """Qwen2-VL's processor has a video part that needs torchvision; where it is missing, awq
    (which runs that processor) is refused naming rtn, and nothing is written."""
    import importlib.util

    from edgeinfer.errors import QuantizeSettingsError

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: Qwen2-VL's processor loads, nothing to refuse")
    out = tmp_path / "q"
    with pytest.raises(QuantizeSettingsError, match="rtn here"):
        quantize_checkpoint(QuantizeOptions(checkpoint("qwen2_vl"), out, QuantSpec(4, 32), method=Method.awq, samples=1))
    assert not (out / "config.json").exists()


# --------------------------------------------------------------------------- AWQ


def outlier_activations(rows: int, seed: int) -> torch.Tensor:
    """Activations whose channels 3, 17, 40 and 51 are 25x the rest, as in LLM hidden states."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=gen)
    x[:, [3, 17, 40, 51]] *= 25.0
    return x


@pytest.mark.parametrize("spec", [QuantSpec(4, 16), QuantSpec(4, 32, False), QuantSpec(8, None), QuantSpec(8, None, False)],
                         ids=["w4-g16", "w4-g32-asym", "w8-channel", "w8-channel-asym"])
def test_the_search_rounds_as_compressed_tensors_does(spec):
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(4)) / 8
    weight[0, :16] = 0.0  # a group of zeros: its scale must not be 0
    weight[1, 16:32] = weight[1, 16:32].abs()  # a group with no negative value
    fast, exact = awq.rounded(weight, spec.weight_args()), fake_quantized(weight, spec.weight_args())
    assert torch.allclose(fast, exact, rtol=0, atol=1e-6), (fast - exact).abs().max()


def test_awq_scales_beat_round_to_nearest_on_outlier_channels():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=gen) / 8
    args = QuantSpec(4, 64).weight_args()
    calibration, held_out = outlier_activations(256, 2), outlier_activations(256, 3)
    scales, alpha = awq.search_scales(calibration, calibration.abs().mean(0), [weight], args)
    exact = [held_out @ weight.T]
    rtn = awq.group_output_error(held_out, [weight], exact, torch.ones(64), args)
    searched = awq.group_output_error(held_out, [weight], exact, scales, args)
    assert alpha > 0
    assert searched < 0.7 * rtn, (searched, rtn)


@pytest.mark.parametrize("family", ["llava", "gemma3"])
@torch.no_grad()
def test_folding_scales_keeps_the_full_precision_function(checkpoint, family):
    """Each group's 1/s goes into the op before it (a plain norm, Gemma's 1 + w norm, or a linear):
    every linear of the group still computes what it did from the op's input."""
    model = load(checkpoint(family), decompress=False)
    gen = torch.Generator().manual_seed(0)
    groups = awq.smooth_groups(model)
    assert len(groups) == 3 * len(model.get_decoder().layers)  # GQA: no v -> o group
    for group in groups:
        previous = group.previous
        width = previous.in_features if isinstance(previous, torch.nn.Linear) else previous.weight.shape[0]
        inputs = torch.randn(3, width, generator=gen)
        before = [linear(previous(inputs)) for linear in group.linears.values()]
        awq.apply_scales(group, torch.rand(next(iter(group.linears.values())).in_features, generator=gen) + 0.5)
        after = [linear(previous(inputs)) for linear in group.linears.values()]
        for old, new in zip(before, after):
            assert torch.allclose(old, new, atol=1e-5, rtol=1e-4), group.name


def test_calibration_folder_pairs_pictures_with_prompts(tmp_path):
    from PIL import Image

    for i, color in enumerate(("red", "blue")):
        Image.new("RGB", (32, 24), color).save(tmp_path / f"{i}.png")
    (tmp_path / "prompts.txt").write_text("What color is it?\n\nIs it big?\n")
    samples = awq.calibration_samples(tmp_path, 3)
    assert [prompt for _, prompt in samples] == ["What color is it?", "Is it big?", "What color is it?"]
    assert [image.getpixel((0, 0)) for image, _ in samples] == [(255, 0, 0), (0, 0, 255), (255, 0, 0)]
    (tmp_path / "prompts.txt").unlink()
    assert {prompt for _, prompt in awq.calibration_samples(tmp_path, 2)} == {awq.DEFAULT_PROMPT}


# --------------------------------------------------------------------------- the command


def quantize_cli(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["quantize", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_cli_writes_the_report_naming_every_quantized_layer(checkpoint, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "old.txt").write_text("x")
    code, answer = quantize_cli(str(checkpoint("llava")), str(out), "--group-size", "32")
    assert code == 2 and answer["error"]["type"] == "QuantizeSettingsError" and "--force" in answer["error"]["message"]

    code, answer = quantize_cli(str(checkpoint("llava")), str(out), "--group-size", "32", "--method", "awq",
                                "--samples", "2", "--force")
    assert code == 0, answer
    written = json.loads((out / REPORT_NAME).read_text())
    assert written == answer
    names = {layer["name"] for layer in written["layers"]}
    assert names == set(language_linears(load(checkpoint("llava"), decompress=False)))
    assert all(layer["alpha"] is not None and layer["output_error"] >= 0 for layer in written["layers"]
               if not layer["name"].endswith("o_proj"))  # GQA: v and o differ in width, so o has no group
    assert all(0 < layer["weight_error"] < 0.5 for layer in written["layers"])
    text = runner.invoke(app, ["quantize", str(checkpoint("llava")), str(out), "--group-size", "0", "--force"]).stdout
    assert "layers.1.mlp.down_proj" in text and "channel" in text and "model.language_model." in text


def test_the_lm_head_takes_four_or_eight_bits_only():
    from edgeinfer.errors import QuantizeSettingsError

    with pytest.raises(QuantizeSettingsError, match="--lm-head is 2; allowed: int4 or int8"):
        QuantSpec(4, 128, lm_head_bits=2)
    assert QuantSpec(4, None, lm_head_bits=4).lm_head_args().strategy == "channel"  # no groups: one scale a row
    assert QuantSpec(8, 64, lm_head_bits=4).lm_head_args().group_size == 64
    for bits in (4, 8):  # the head is symmetric whatever the layers are
        assert QuantSpec(4, 128, symmetric=False, lm_head_bits=bits).lm_head_args().symmetric


@pytest.mark.parametrize("head,bits,group", [("int8", 8, None), ("int4", 4, 32)])
def test_cli_quantizes_the_lm_head_when_asked(checkpoint, tmp_path, head, bits, group):
    code, answer = quantize_cli(str(checkpoint("llava")), str(tmp_path / "q"), "--group-size", "32", "--lm-head", head)
    assert code == 0, answer
    layer = next(layer for layer in answer["layers"] if layer["name"] == "lm_head")
    assert (layer["bits"], layer["group_size"]) == (bits, group)


@pytest.mark.parametrize("args,code,needle", [
    (["--bits", "3"], 2, "--bits is 3; allowed: 4 or 8"),
    (["--group-size", "48"], 2, "takes 64"),
    (["--samples", "0", "--method", "awq"], 2, "--samples"),
    (["--calibration", "."], 2, "awq (rtn needs no calibration data)"),
    (["--dtype", "int8"], 2, "--dtype is int8; allowed: float32, float16, bfloat16"),
])
def test_cli_refuses_settings_it_cannot_honour(checkpoint, tmp_path, args, code, needle):
    got, answer = quantize_cli(str(checkpoint("llava")), str(tmp_path / "q"), *args)
    assert got == code and needle in answer["error"]["message"], answer
    assert not (tmp_path / "q").exists()


def test_cli_refuses_an_unsupported_family(tmp_path):
    source = tmp_path / "bert"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    code, answer = quantize_cli(str(source), str(tmp_path / "q"))
    assert code == 3 and answer["error"]["code"] == "unsupported_architecture"
    assert "BertModel" in answer["error"]["message"] and "LlavaForConditionalGeneration" in answer["error"]["message"]
