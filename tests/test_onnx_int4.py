"""The ONNX Runtime backend with 4-bit blocked decoder weights and an int8 vision graph.

The reference for the int4 graph is the torch backend running the very weights the graph
holds, dequantized block by block (``dequantized_weights``): with float32 activations
(accuracy level 0) the tokens must be the same, token for token.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from edgeinfer.backends.onnx.build import BuildSpec, build_engines, engine_problems
from edgeinfer.backends.onnx.export import DECODER_FILE, VISION_FILE, check_graph, check_vision, cpu_session
from edgeinfer.backends.onnx.graphs import decoder_example, vision_graph_for
from edgeinfer.backends.onnx.quantize import (
    Int4Options,
    dequantized_weights,
    quantize_decoder_int4,
    quantize_vision,
)
from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.errors import EngineBuildError
from edgeinfer.models.loader import load_model
from tests.conftest import first_divergence, noise_image

pytest.importorskip("onnx_ir", reason="onnxruntime's MatMulNBitsQuantizer imports onnx_ir (pip install onnx-ir)")

FORCED = SamplingParams(max_new_tokens=24, min_new_tokens=24)
QUESTIONS = [
    ("how many red circle are there in the top left of the image ?", [noise_image(128, 96, seed=1)]),
    ("describe this picture", []),
    ("color", [noise_image(80, 128, seed=7), noise_image(64, 96, seed=8)]),
]
# The decoder's weight MatMuls in a two-layer tiny graph: qkv, o, gate_up, down per layer, and the head.
WEIGHT_MATMULS = 2 * 4 + 1


def config(**overrides) -> EngineConfig:
    return EngineConfig(**{"num_blocks": 256, **overrides})


def tokens(engine: Engine) -> list[list[int]]:
    return [engine.generate(q, images, FORCED).token_ids for q, images in QUESTIONS]


def load_dequantized(decoder, graph, weight_matmuls: int = WEIGHT_MATMULS) -> dict[str, np.ndarray]:
    """Give the torch decoder the weights the quantized graph multiplies by (``weight_matmuls`` of
    them, each the shape of the parameter it names) and return them; token embeddings keep the
    checkpoint's table (the engine looks them up on the host, unquantized)."""
    weights = dequantized_weights(graph)
    assert len(weights) == weight_matmuls
    if decoder.embed is None:  # tied: the table is the head's, which is about to change
        decoder.embed = torch.nn.Parameter(decoder.embed_table.detach().clone())
    with torch.no_grad():
        for name, value in weights.items():
            parameter = decoder.get_parameter(name.removeprefix("decoder."))
            assert tuple(parameter.shape) == value.shape, name
            parameter.data = torch.from_numpy(value)
    return weights


def test_int4_graph_holds_matmulnbits_and_equals_torch_on_dequantized_weights(exported_graphs, tmp_path):
    model, folder = exported_graphs("smolvlm")
    target = tmp_path / DECODER_FILE
    record = quantize_decoder_int4(folder / DECODER_FILE, target, Int4Options(block_size=32, symmetric=False,
                                                                                accuracy_level=0))
    check_graph(target)
    nodes = onnx.load(str(target)).graph.node
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert len(nbits) == WEIGHT_MATMULS == record["ops"]["MatMulNBits"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nbits[0].attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 32 and "accuracy_level" not in attrs
    assert len(nbits[0].input) == 4  # asymmetric: zero points
    assert (target.stat().st_size < 0.3 * (folder / DECODER_FILE).stat().st_size)

    reference = load_model(model.adapter.checkpoint.path).decoder
    load_dequantized(reference, target)
    session = cpu_session(target)
    for case in ({"batch": 1, "tokens": 6, "context": [0]}, {"batch": 3, "tokens": 1, "context": [11, 3, 1]}):
        inputs = decoder_example(reference, block_size=16, **case)
        with torch.no_grad():
            expected = reference(**inputs)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        scale = float(expected[0].abs().max())
        for g, e in zip(got, expected):
            assert float((torch.from_numpy(g) - e).abs().max()) <= 1e-4 * max(1.0, scale)


def test_int4_engine_gives_the_tokens_of_torch_on_the_same_blocks(checkpoint, tmp_path):
    """End to end, accuracy level 0: the ORT int4 engine and the torch engine over the dequantized
    blocks give the same tokens. The fp32 build's tokens (the same weights before quantization)
    are where the quantization shows: their first divergence is printed, not asserted."""
    path = checkpoint("smolvlm")
    spec = BuildSpec.custom("int4", precision="int4", int4=Int4Options(accuracy_level=0))
    folder = build_engines(load_model(path), spec, tmp_path, progress=False).folder
    ort = Engine.load(path, backend="onnxruntime", config=config(profile_name="int4"), engines_root=tmp_path)
    assert (ort.engines.backend, ort.engines.precision) == ("onnxruntime", "int4")
    got = tokens(ort)
    del ort
    reference = Engine.load(path, backend="torch", config=config())
    load_dequantized(reference.engines.decoder.decoder, folder / DECODER_FILE)  # before any K/V is cached
    assert got == tokens(reference)
    fp32 = tokens(Engine.load(path, backend="torch", config=config()))
    print("int4 vs fp32 weights, first divergence per question:", [first_divergence(a, b) for a, b in zip(got, fp32)])


def test_accuracy_level_4_stays_close_to_the_same_blocks(exported_graphs, tmp_path):
    """int8 activations (accuracy level 4) change the products a little, the weights not at all."""
    model, folder = exported_graphs("smolvlm")
    level0, level4 = tmp_path / "l0.onnx", tmp_path / "l4.onnx"
    quantize_decoder_int4(folder / DECODER_FILE, level0, Int4Options(accuracy_level=0))
    quantize_decoder_int4(folder / DECODER_FILE, level4, Int4Options(accuracy_level=4))
    attrs = {a.name: a.i for n in onnx.load(str(level4)).graph.node if n.op_type == "MatMulNBits" for a in n.attribute}
    assert attrs["accuracy_level"] == 4
    same = dequantized_weights(level0), dequantized_weights(level4)
    assert all(np.array_equal(same[0][k], same[1][k]) for k in same[0])
    inputs = decoder_example(model.decoder, batch=2, tokens=5, block_size=16, context=[3, 7])
    feeds = {k: v.numpy() for k, v in inputs.items()}
    exact, approx = (cpu_session(p).run(None, feeds)[0] for p in (level0, level4))
    assert np.abs(exact - approx).max() <= 0.05 * np.abs(exact).max()


def test_qdq_int4_is_block_quantized_dequantizelinear_that_ort_runs(exported_graphs, tmp_path):
    """The qdq form: int4 weights in a blocked DequantizeLinear before a plain MatMul, opset 21,
    symmetric with positive scales (what TensorRT 10's weight-only INT4 takes); ORT runs it."""
    model, folder = exported_graphs("smolvlm")
    qdq = tmp_path / "qdq.onnx"
    record = quantize_decoder_int4(folder / DECODER_FILE, qdq, Int4Options(format="qdq", block_size=64,
                                                                            symmetric=True))
    check_graph(qdq)
    graph = onnx.load(str(qdq))
    assert record["opset"] == 21 == next(o.version for o in graph.opset_import if o.domain == "")
    weights = {t.name: t for t in graph.graph.initializer}
    dq = [n for n in graph.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == WEIGHT_MATMULS and not any(n.op_type == "MatMulNBits" for n in graph.graph.node)
    assert {weights[n.input[0]].data_type for n in dq} == {onnx.TensorProto.INT4}
    assert all(len(n.input) == 2 for n in dq)  # no zero points
    assert {onnx.helper.get_attribute_value(a) for n in dq for a in n.attribute if a.name == "block_size"} == {64}
    assert all((onnx.numpy_helper.to_array(weights[n.input[1]]) > 0).all() for n in dq)
    originals = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(folder / DECODER_FILE)).graph.initializer}
    for name, w in dequantized_weights(qdq).items():  # round to nearest: within half a step of 1/7 of the block's max
        step = np.abs(originals[name]).max() / 7
        assert np.abs(w - originals[name]).max() <= 0.5 * step + 1e-6
    reference = load_model(model.adapter.checkpoint.path).decoder
    load_dequantized(reference, qdq)
    inputs = decoder_example(reference, batch=1, tokens=4, block_size=16, context=[2])
    with torch.no_grad():
        expected = reference(**inputs)[0].numpy()
    got = cpu_session(qdq).run(None, {k: v.numpy() for k, v in inputs.items()})[0]
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()


def test_head_choices(exported_graphs, tmp_path):
    _, folder = exported_graphs("smolvlm")
    for head, bits in (("int8", {4, 8}), ("fp32", {4})):
        target = tmp_path / f"{head}.onnx"
        record = quantize_decoder_int4(folder / DECODER_FILE, target, Int4Options(head=head))
        nodes = onnx.load(str(target)).graph.node
        found = {a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
        assert found == bits and record["vocab_projection"] == head
        assert sum(n.op_type == "MatMulNBits" for n in nodes) == WEIGHT_MATMULS - (head == "fp32")


def test_int8_vision_graph_runs_close_to_torch(exported_graphs, tmp_path):
    model, folder = exported_graphs("smolvlm")
    target = tmp_path / VISION_FILE
    quantize_vision(folder / VISION_FILE, target)
    check_graph(target)
    ops = {n.op_type for n in onnx.load(str(target)).graph.node}
    assert {"MatMulInteger", "ConvInteger"} <= ops or "DynamicQuantizeMatMul" in ops
    check = check_vision(vision_graph_for(model), model.adapter, target)
    assert 0 < check["max_abs_diff"] and check["cosine"] >= 0.8


def test_fused_int8_vision_graph_keeps_the_patch_mask(exported_graphs, tmp_path):
    """The tower's attention fused and quantized (QAttention) still masks the patches a tile's
    padding covers: with half of one tile masked, it stays as close to torch as the unfused int8
    graph does, where the same graph without its mask does not."""
    from edgeinfer.backends.onnx.export import sample_images

    model, folder = exported_graphs("smolvlm")
    graph = vision_graph_for(model)
    fused, plain = tmp_path / "fused.onnx", tmp_path / "plain.onnx"
    record = quantize_vision(folder / VISION_FILE, fused, graph.fused_attention())
    quantize_vision(folder / VISION_FILE, plain)
    assert record["fused"]["Attention"] == model.adapter.config.vision_config.num_hidden_layers, record
    ops = [n.op_type for n in onnx.load(str(fused)).graph.node]
    assert "QAttention" in ops and "Softmax" not in ops
    tensors = model.adapter.process_image(sample_images()[0]).tensors
    mask = tensors["pixel_attention_mask"].clone()
    mask[-1, :, mask.shape[-1] // 2:] = False  # the right half of the last tile is padding
    tensors = {**tensors, "pixel_attention_mask": mask}
    feeds = graph.feeds(tensors)
    assert not bool(feeds["patch_attention_mask"].all())
    with torch.no_grad():
        expected = graph.module()(*feeds.values()).float()

    def error(path):
        session = cpu_session(path)
        got = session.run(None, {i.name: feeds[i.name].numpy() for i in session.get_inputs()})[0]
        return float((torch.from_numpy(got) - expected).abs().max() / expected.abs().max())

    unmasked = tmp_path / "unmasked.onnx"
    bare = onnx.load(str(fused))
    for node in bare.graph.node:
        if node.op_type == "QAttention":
            node.input[5] = ""
    onnx.save(bare, str(unmasked))
    assert error(fused) <= 2 * error(plain) + 0.02, (error(fused), error(plain))
    assert error(unmasked) > 2 * error(fused), "the mask made no difference: the test cannot tell"


def test_cli_builds_int4_with_int8_vision_and_the_manifest_says_so(checkpoint, tmp_path):
    from edgeinfer.artifacts import read_manifest
    from edgeinfer.cli.main import app

    path = checkpoint("smolvlm")
    args = ["build", "--model", str(path), "--profile", "cpu", "--out", str(tmp_path), "--precision", "int4",
            "--int4-block-size", "64", "--int4-asymmetric", "--vision-precision", "int8", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)["manifest"]
    decoder, vision = manifest["engines"]["decoder"], manifest["engines"]["vision"]
    assert manifest["precision"] == "int4" == decoder["precision"]
    assert decoder["quantization"]["options"] == {"block_size": 64, "symmetric": False, "accuracy_level": 4,
                                                  "format": "matmulnbits", "head": "int4"}
    assert vision["precision"] == "int8" and vision["quantization"]["check"]["cosine"] >= 0.8
    folder = tmp_path / path.name / "cpu"
    from edgeinfer.profiles import load_profile

    spec = BuildSpec.from_profile(load_profile("cpu"), "int4", int4=Int4Options(block_size=64, symmetric=False),
                                  vision_precision="int8")
    fp = read_manifest(folder).fingerprint.model
    assert engine_problems(folder, spec, fp) == []
    assert engine_problems(folder, BuildSpec.from_profile(load_profile("cpu"), "int4"), fp) == [
        "int4 block_size 64 -> 128", "int4 symmetric False -> True", "vision precision int8 -> fp32"]
    # A run takes the build as it is, on ORT: the int8 vision graph answers the picture.
    engine = Engine.load(path, profile="cpu", backend="auto", engines_root=tmp_path)
    assert (engine.engines.backend, engine.engines.precision) == ("onnxruntime", "int4")
    assert len(engine.generate(*QUESTIONS[0], FORCED).token_ids) == FORCED.max_new_tokens
    # Image embeddings of the int8 graph, and the K/V after them, are cached apart from an fp32 graph's.
    assert json.loads(engine.engines.build_identity)["vision"]["precision"] == "int8"


def test_unknown_precisions_and_options_are_typed_errors(checkpoint, tmp_path):
    from edgeinfer.cli.main import app

    with pytest.raises(EngineBuildError, match="precision 'int3' is not supported.*fp32, int8, int4"):
        BuildSpec.custom(precision="int3")
    with pytest.raises(EngineBuildError, match="int4 block size 48 is not supported.*32, 64, 128"):
        Int4Options(block_size=48)
    with pytest.raises(EngineBuildError, match="int4 accuracy level 5"):
        Int4Options(accuracy_level=5)
    with pytest.raises(EngineBuildError, match="vision precision 'int4'"):
        BuildSpec.custom(vision_precision="int4")
    with pytest.raises(EngineBuildError, match="int4 options were given for a int8 build"):
        BuildSpec.custom(precision="int8", int4=Int4Options(block_size=64))
    with pytest.raises(EngineBuildError, match="qdq"):
        Int4Options(format="qdq", symmetric=True, head="int8")
    with pytest.raises(EngineBuildError, match="symmetric"):
        Int4Options(format="qdq", symmetric=False)
    runner = CliRunner()
    base = ["build", "--model", str(checkpoint("smolvlm")), "--out", str(tmp_path)]
    unknown = runner.invoke(app, [*base, "--precision", "int5"])
    assert unknown.exit_code == 2 and "int5" in unknown.output
    bad = runner.invoke(app, [*base, "--precision", "int4", "--int4-block-size", "48"])
    assert bad.exit_code == EngineBuildError.exit_code and "block size 48" in bad.output
    assert not (tmp_path / checkpoint("smolvlm").name).exists()
