"""Quantized checkpoints (compressed-tensors, GPTQ, AWQ) load and generate transformers' own tokens.

compressed-tensors checkpoints are written through compressed-tensors itself, as
llm-compressor writes them, and transformers loads the same folder and decompresses it.
transformers needs gptqmodel / autoawq for GPTQ and AWQ checkpoints, which do not install here,
so for those the reference is transformers' ``generate()`` on the same checkpoint dequantized by
the published formulas written out plainly in this file (:func:`plain_dense`), not by our
unpacking code.
"""

from __future__ import annotations

import json
import shutil
from functools import cache

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.errors import ModelLoadError, UnsupportedQuantizationError, exit_code_for
from edgeinfer.models.loader import load_model
from edgeinfer.quant import SUPPORTED, QuantizedWeight, parse_quant_config
from edgeinfer.quant import weights as quant_weights
from edgeinfer.testing.quantized import quantize_awq, quantize_compressed_tensors, quantize_gptq
from tests.conftest import noise_image

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install 'edgeinfer[quant]')")
# transformers warns that the checkpoint's own quantization_config is kept when dequantize=True is passed.
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

QUESTION = "how many circle are there ?"
FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
MIN_DISTINCT = 12  # a near-constant sequence would make a comparison meaningless
IMAGE = [noise_image(120, 80, seed=1)]
# The families of the parity tests, text for each. The vision towers stay dense, so the image
# case is run for one family (M-RoPE image positions), keeping the file within the CI budget.
FAMILIES = ["smolvlm", "idefics3", "llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl",
            "internvl_qwen3", "gemma3"]
IMAGE_FAMILIES = ["qwen2_vl"]


@cache
def engine_for(path) -> Engine:
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=256))


def ours(path, images, engine: Engine | None = None) -> tuple[Engine, list[int], list[int]]:
    """(engine, prompt ids, 32 greedy tokens); the engine loaded once per folder unless given."""
    engine = engine or engine_for(path)
    seq = engine.submit(QUESTION, images, FORCED)
    return engine, seq.prompt_ids, engine.run_until_done([seq])[0].token_ids


def fresh(path) -> Engine:
    """An engine that loads the folder again (after a test changed how it is read)."""
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=256))


def transformers_tokens(model, family: str, engine: Engine, prompt_ids: list[int], images) -> list[int]:
    if images:
        from tests.test_family_qwen2_vl import hf_inputs

        assert family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), "transformers image inputs are built for Qwen here"
        inputs = hf_inputs(engine, prompt_ids, images)
    else:
        ids = torch.tensor([prompt_ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@cache
def transformers_compressed(path):
    """transformers' model of a compressed-tensors folder, decompressed by compressed-tensors.

    ``dequantize=True`` decompresses each stored layer by its checkpoint name. The default
    route (transformers 5.24 with compressed-tensors 0.20.1) matches the config's ``ignore``
    list, which compressed-tensors writes in checkpoint names, against the in-memory module
    names; where a family renames on load (Qwen2-VL's ``visual.*`` is ``model.visual.*``) it
    then expects the dense vision tower to be packed.
    """
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    return AutoModelForImageTextToText.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


def transformers_dense(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path).eval()


def assert_same_tokens(path, model, family: str, images) -> list[int]:
    engine, prompt_ids, tokens = ours(path, images)
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == transformers_tokens(model, family, engine, prompt_ids, images)
    return tokens


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    """quantized(family, kind) -> folder of ``family``'s tiny checkpoint quantized as ``kind`` (built once)."""
    kinds = {
        "w4a16_g32": lambda src, out: quantize_compressed_tensors(src, out, bits=4, group_size=32),
        "w4a16_g32_asym": lambda src, out: quantize_compressed_tensors(src, out, bits=4, group_size=32,
                                                                       symmetric=False),
        "w8a16_channel": lambda src, out: quantize_compressed_tensors(src, out, bits=8, group_size=None),
        "gptq_sym_act_order": lambda src, out: quantize_gptq(src, out, bits=4, group_size=32, desc_act=True),
        "gptq_asym": lambda src, out: quantize_gptq(src, out, bits=4, group_size=32, symmetric=False),
        "awq_gemm": lambda src, out: quantize_awq(src, out, group_size=32),
    }
    built = {}

    def get(family: str, kind: str):
        if (family, kind) not in built:
            built[family, kind] = kinds[kind](checkpoint(family), tmp_path_factory.mktemp(f"{family}-{kind}"))
        return built[family, kind]

    return get


# --- compressed-tensors, against transformers' own decompression ------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_w4a16_group32_text_matches_transformers(quantized, family):
    path = quantized(family, "w4a16_g32")
    assert_same_tokens(path, transformers_compressed(path), family, [])


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_w4a16_group32_image_matches_transformers(quantized, family):
    path = quantized(family, "w4a16_g32")
    assert_same_tokens(path, transformers_compressed(path), family, IMAGE)


@pytest.mark.parametrize("kind", ["w4a16_g32_asym", "w8a16_channel"])
def test_asymmetric_and_8bit_channel_match_transformers(quantized, kind):
    path = quantized("qwen2_vl", kind)
    assert_same_tokens(path, transformers_compressed(path), "qwen2_vl", [])


def test_packed_weights_are_kept_only_when_asked(quantized):
    model = load_model(quantized("qwen2_vl", "w4a16_g32"))  # on a CPU: dense, dequantized at load
    assert model.quantized.weights == {} and len(model.quantized.layers) == 2 * 7 and model.quantized.nbytes > 0
    assert all(isinstance(p, torch.nn.Parameter) for p in model.decoder.layers[0].parameters())


def test_packed_weights_are_kept_and_only_the_language_model_is_quantized(quantized):
    model = load_model(quantized("qwen2_vl", "w4a16_g32"), keep_packed=True)
    packed = model.quantized.weights
    assert set(packed) == set(model.quantized.layers)
    assert len(packed) == 2 * 7  # two layers of q, k, v, o, gate, up, down
    assert all(".layers." in name and "visual" not in name for name in packed)
    weight = packed["model.layers.0.mlp.down_proj"]
    assert (weight.bits, weight.group_size, weight.shape, weight.packed.dtype) == (4, 32, (64, 128), torch.int32)
    assert model.quantized.nbytes < sum(w.shape[0] * w.shape[1] * 4 for w in packed.values()) / 4


# --- GPTQ and AWQ, against the published formulas written out plainly -------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM pack order: nibble i holds column AWQ_ORDER[i] of 8


def plain_weight(q: dict, qweight, qzeros, scales, g_idx) -> torch.Tensor:
    """One GPTQ / AWQ layer's [out, in] weight by the formats' published formulas (``q`` the
    ``quantization_config``), one bit field at a time, computed in the scales' dtype."""
    bits, mask = q["bits"], (1 << q["bits"]) - 1
    per = 32 // bits
    if q["quant_method"] == "gptq":  # qweight [in/per, out]: input row r*per + j in bits j*b of word r
        rows, out_features = qweight.shape[0] * per, qweight.shape[1]
        w = torch.zeros(rows, out_features, dtype=torch.int64)
        z = torch.zeros(qzeros.shape[0], qzeros.shape[1] * per, dtype=torch.int64)
        for j in range(per):
            w[j::per] = (qweight.long() >> (bits * j)) & mask
            z[:, j::per] = (qzeros.long() >> (bits * j)) & mask
        if q["checkpoint_format"] == "gptq":
            z = z + 1  # the classic format stores each zero minus one
        groups = g_idx.long()
    else:  # AWQ GEMM: qweight [in, out/8], nibble i of word c is output column 8c + AWQ_ORDER[i]
        rows, out_features = qweight.shape[0], qweight.shape[1] * 8
        w = torch.zeros(rows, out_features, dtype=torch.int64)
        z = torch.zeros(qzeros.shape[0], out_features, dtype=torch.int64)
        for i in range(8):
            w[:, AWQ_ORDER[i]::8] = (qweight.long() >> (4 * i)) & mask
            z[:, AWQ_ORDER[i]::8] = (qzeros.long() >> (4 * i)) & mask
        groups = torch.arange(rows) // q["group_size"]
    dense = (w.to(scales.dtype) - z[groups].to(scales.dtype)) * scales[groups]  # [in, out]
    return dense.t().float().contiguous()


def plain_dense(path, out):
    """A dense copy of the GPTQ / AWQ checkpoint at ``path``, each layer by :func:`plain_weight`."""
    config = json.loads((path / "config.json").read_text())
    q = config.pop("quantization_config")
    tensors = load_file(path / "model.safetensors")
    for layer in [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]:
        stored = [tensors.pop(f"{layer}.{n}", None) for n in ("qweight", "qzeros", "scales", "g_idx")]
        tensors[f"{layer}.weight"] = plain_weight(q, *stored)
    out.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("bits, group_size, symmetric", [(8, 32, True), (8, -1, False), (4, -1, True)])
def test_gptq_8bit_and_channel_layers_dequantize_by_the_published_formula(bits, group_size, symmetric):
    """8-bit and one-group-per-row GPTQ on one layer (act-order where grouped), against the plain formula."""
    from edgeinfer.quant import dequantize_tensors
    from edgeinfer.testing.quantized import pack_columns, pack_rows, round_to_nearest

    gen = torch.Generator().manual_seed(bits + group_size)
    weight = torch.randn(48, 64, generator=gen)
    g_idx = torch.randperm(64, generator=gen) // group_size if group_size > 0 else torch.zeros(64, dtype=torch.long)
    codes, zeros, scales = round_to_nearest(weight, bits, g_idx, symmetric)
    fmt = "gptq" if symmetric else "gptq_v2"
    stored = [pack_rows(codes.t(), bits), pack_columns(((zeros - 1) if symmetric else zeros).t() & ((1 << bits) - 1),
                                                       bits), scales.t().contiguous(), g_idx.to(torch.int32)]
    q = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": group_size > 0,
         "sym": symmetric, "checkpoint_format": fmt}
    names = ("qweight", "qzeros", "scales", "g_idx")
    tensors = {f"proj.{n}": t for n, t in zip(names, stored)}
    dense, _ = dequantize_tensors(tensors, parse_quant_config(q), torch.float32)
    assert torch.equal(dense["proj.weight"], plain_weight(q, *stored))
    assert (dense["proj.weight"] - weight).abs().max() <= scales.float().max() * 0.51
    kept, packed = dequantize_tensors(tensors, parse_quant_config(q), torch.float32, keep_packed=True)
    assert kept["proj.weight"] is packed.weights["proj"] and packed.weights["proj"].bits == bits
    assert torch.equal(kept["proj.weight"].dequantize(torch.float32), dense["proj.weight"])


CASES = {"text": [], "one_image": IMAGE}


@pytest.fixture(scope="module")
def plain_reference(quantized, tmp_path_factory):
    """plain_reference(kind, case) -> transformers' tokens on the plainly dequantized qwen2_vl
    ``kind`` checkpoint, for our prompt ids of ``case``."""
    models, done = {}, {}

    def get(kind: str, case: str):
        if kind not in models:
            path = quantized("qwen2_vl", kind)
            models[kind] = transformers_dense(plain_dense(path, tmp_path_factory.mktemp(f"dense-{kind}")))
        if (kind, case) not in done:
            engine, prompt_ids, _ = ours(quantized("qwen2_vl", kind), CASES[case])
            done[kind, case] = transformers_tokens(models[kind], "qwen2_vl", engine, prompt_ids, CASES[case])
        return done[kind, case]

    return get


@pytest.mark.parametrize("kind, case", [("gptq_sym_act_order", "text"), ("gptq_asym", "text"), ("awq_gemm", "text")])
def test_gptq_and_awq_match_transformers_on_the_plainly_dequantized_checkpoint(quantized, plain_reference, kind,
                                                                              case):
    _, _, tokens = ours(quantized("qwen2_vl", kind), CASES[case])
    assert len(set(tokens)) >= MIN_DISTINCT
    assert tokens == plain_reference(kind, case)


def test_awq_read_without_its_interleave_changes_the_tokens(quantized, plain_reference, monkeypatch):
    path = quantized("qwen2_vl", "awq_gemm")
    monkeypatch.setattr(quant_weights, "AWQ_PACK_ORDER", tuple(range(8)))
    _, _, tokens = ours(path, [], fresh(path))
    assert tokens != plain_reference("awq_gemm", "text")


def test_act_order_read_without_g_idx_changes_the_tokens(quantized, plain_reference, monkeypatch):
    path = quantized("qwen2_vl", "gptq_sym_act_order")
    monkeypatch.setattr(QuantizedWeight, "group_index", lambda self: torch.arange(self.shape[1]) // self.group_size)
    _, _, tokens = ours(path, [], fresh(path))
    assert tokens != plain_reference("gptq_sym_act_order", "text")


# --- refusals ---------------------------------------------------------------------------

UNSUPPORTED = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "awq gemv": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
    "gptq marlin": {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
    "gptq 3-bit": {"quant_method": "gptq", "bits": 3, "group_size": 128},
    "exllama": {"quant_method": "exl2"},
    "nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                       "group_size": 16}}}},
    "fp8 compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
    "w4a8": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                       "group_size": 128},
                    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_an_unsupported_format_is_refused_with_the_supported_list(name):
    with pytest.raises(UnsupportedQuantizationError) as caught:
        parse_quant_config(UNSUPPORTED[name])
    message = str(caught.value)
    assert all(entry in message for entry in SUPPORTED)
    assert exit_code_for(caught.value) == 3


def test_an_unsupported_checkpoint_fails_at_load_naming_its_format(quantized, tmp_path):
    path = shutil.copytree(quantized("qwen2_vl", "w4a16_g32"), tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = UNSUPPORTED["fp8"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="quant_method 'fp8'"):
        load_model(path)


def test_a_truncated_packed_tensor_is_named_with_its_expected_shape(quantized, tmp_path):
    path = shutil.copytree(quantized("qwen2_vl", "gptq_asym"), tmp_path / "cut")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.scales"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.scales has shape \[1, 128\], "
                                             r"expected \[2, 128\]"):
        load_model(path)


# --- doctor ------------------------------------------------------------------------------

def test_doctor_prints_the_weight_format_and_bytes(quantized, tmp_path):
    from typer.testing import CliRunner

    from edgeinfer.cli.main import app
    from tests.test_doctor import make_cpu

    path = quantized("qwen2_vl", "gptq_asym")
    result = CliRunner().invoke(app, ["doctor", "--root", str(make_cpu(tmp_path / "root")), "--json", "--model",
                                      str(path), "--engines", str(tmp_path / "engines"), "--profile", "cpu"])
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    weights = checks["model weights"]
    assert weights["status"] == "pass"
    assert weights["detail"].startswith("gptq W4A16 g32 asym, ") and "(14 quantized layers: " in weights["detail"]


def test_the_format_label_names_a_group_that_names_its_layers():
    """A quantized lm_head has its own group (``--lm-head``): doctor says which group is the head's."""
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights},
                                "group_1": {"targets": ["lm_head"],
                                            "weights": {**weights, "num_bits": 8, "strategy": "channel",
                                                        "group_size": None}}}}
    assert parse_quant_config(config).label == "compressed-tensors W4A16 g128, W8A16 channel (lm_head)"


def test_weight_footprint_counts_the_packed_bytes(quantized, checkpoint):
    from edgeinfer.quant.footprint import weight_footprint

    dense = weight_footprint(checkpoint("qwen2_vl"))
    packed = weight_footprint(quantized("qwen2_vl", "w4a16_g32"))
    assert (dense.format, dense.quantized_layers) == ("dense F32", 0)
    assert packed.quantized_layers == 14
    # 4-bit values with one fp32 scale per 32: about a seventh of the fp32 bytes of those layers
    layer_bytes = sum(load_file(checkpoint("qwen2_vl") / "model.safetensors")[n].numel() * 4
                      for n in load_file(checkpoint("qwen2_vl") / "model.safetensors")
                      if ".layers." in n and n.endswith("proj.weight") and "visual" not in n)
    assert layer_bytes / 8 < packed.quantized_bytes < layer_bytes / 4
    assert dense.total_bytes - packed.total_bytes > layer_bytes / 2


def test_doctor_says_what_packed_layers_leave_the_kv_pool_on_a_gpu_profile(quantized):
    from edgeinfer.doctor import check_model_weights
    from edgeinfer.profiles import load_profile
    from edgeinfer.quant.footprint import weight_footprint

    path = quantized("qwen2_vl", "w4a16_g32")
    model = load_model(path, keep_packed=True)
    values = sum(w.shape[0] * w.shape[1] for w in model.quantized.weights.values())
    footprint = weight_footprint(path)
    assert footprint.quantized_values == values
    assert footprint.saved_bytes(2) == values * 2 - footprint.quantized_bytes
    cuda = check_model_weights(path, load_profile("cuda"))
    saved = footprint.saved_bytes(2) // 2**20
    assert cuda.status == "pass" and f"4096 + {saved} = {4096 + saved} MiB" in cuda.detail
    assert "packed" not in check_model_weights(path, load_profile("cpu")).detail  # the CPU dequantizes
    off = check_model_weights(path, load_profile("cuda"), kernels_off="Triton is not installed")
    assert off.status == "warn" and "dequantized at load (Triton is not installed)" in off.detail


def test_a_gpu_whose_kernels_cannot_run_dequantizes_at_load(monkeypatch):
    """Where the low-bit kernels cannot run on a GPU, the decoder is dequantized at load rather than
    rebuilt in torch at every product; where they run it stays packed; a CPU always dequantizes."""
    from edgeinfer.models.loader import keeps_packed
    from edgeinfer.quant import kernels

    monkeypatch.setattr(kernels, "usable", lambda device: False)  # no Triton, or none that builds for the GPU
    assert not keeps_packed("cuda:0") and not keeps_packed("cpu")
    monkeypatch.setattr(kernels, "usable", lambda device: device.type == "cuda")
    assert keeps_packed("cuda:0") and not keeps_packed("cpu")


def test_doctor_fails_an_unsupported_format(quantized, tmp_path):
    from edgeinfer.doctor import check_model_weights

    path = shutil.copytree(quantized("qwen2_vl", "w4a16_g32"), tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = UNSUPPORTED["fp8"]
    (path / "config.json").write_text(json.dumps(config))
    check = check_model_weights(path)
    assert check.status == "fail" and "quant_method 'fp8'" in check.detail


def test_compressed_tensors_act_order_reads_each_column_s_group_from_g_idx():
    """Older compressed-tensors act-order checkpoints map each input column to its group
    through ``weight_g_idx``: the column's own scale and zero point, not those of i // 32."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from edgeinfer.quant import dequantize_tensors

    gen = torch.Generator().manual_seed(0)
    out, cols, bits = 16, 64, 4
    codes = torch.randint(-8, 8, (out, cols), generator=gen, dtype=torch.int8)
    zeros = torch.randint(-3, 4, (out, 2), generator=gen, dtype=torch.int8)
    scales = torch.rand(out, 2, generator=gen) + 0.5
    g_idx = torch.randperm(cols, generator=gen) % 2
    tensors = {"layers.0.mlp.down_proj.weight_packed": pack_to_int32(codes, bits),
               "layers.0.mlp.down_proj.weight_scale": scales,
               "layers.0.mlp.down_proj.weight_zero_point": pack_to_int32(zeros, bits, packed_dim=0),
               "layers.0.mlp.down_proj.weight_shape": torch.tensor([out, cols]),
               "layers.0.mlp.down_proj.weight_g_idx": g_idx.to(torch.int32)}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                           "symmetric": False, "actorder": "group"}}}}
    dense, _ = dequantize_tensors(tensors, parse_quant_config(config), torch.float32)
    expected = torch.empty(out, cols)
    for o in range(out):
        for i in range(cols):
            g = int(g_idx[i])
            expected[o, i] = (int(codes[o, i]) - int(zeros[o, g])) * scales[o, g]
    assert torch.equal(dense["layers.0.mlp.down_proj.weight"], expected)
    del tensors["layers.0.mlp.down_proj.weight_g_idx"]
    missing = r"lacks layers\.0\.mlp\.down_proj\.weight_g_idx \(expected shape \[64\]\)"
    with pytest.raises(ModelLoadError, match=missing):
        dequantize_tensors(tensors, parse_quant_config(config), torch.float32)


def test_a_packed_layer_that_the_config_ignores_is_refused(quantized):
    from edgeinfer.quant import dequantize_tensors

    path = quantized("qwen2_vl", "w4a16_g32")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    config["ignore"] = [*config["ignore"], "model.layers.0.mlp.up_proj"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_packed is packed, but the "
                                             r"quantization config leaves model\.layers\.0\.mlp\.up_proj unquantized"):
        dequantize_tensors(load_file(path / "model.safetensors"), parse_quant_config(config), torch.float32)
