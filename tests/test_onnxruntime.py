"""The ONNX export and the ONNX Runtime backend, token for token against the torch backend."""

from __future__ import annotations

from collections import Counter

import json

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from edgeinfer.backends.onnx.export import DECODER_FILE, OPSET, VISION_FILE

from edgeinfer.artifacts import MANIFEST, checkpoint_fingerprint, read_manifest
from edgeinfer.backends.onnx.build import BuildSpec, build_engines, engine_problems

from edgeinfer.backends.onnx.graphs import decoder_example
from edgeinfer.backends.onnx.runtime import CPU, CUDA, TENSORRT, open_engines, select_providers
from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.errors import BackendUnavailableError, EngineBuildError
from edgeinfer.models.loader import load_model
from edgeinfer.models.registry import supported_architectures
from tests.conftest import noise_image

FORCED = SamplingParams(max_new_tokens=24, min_new_tokens=24)
QUESTIONS = [
    ("how many red circle are there in the top left of the image ?", [noise_image(128, 96, seed=1)]),
    ("describe this picture", []),
    ("what is in the image ?", [noise_image(64, 64, seed=5)]),
    ("color", [noise_image(80, 128, seed=7), noise_image(64, 96, seed=8)]),
]
ARCHITECTURES = {"smolvlm": "SmolVLMForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration",
                 "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                 "llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration"}
FAMILIES = [f for f, arch in ARCHITECTURES.items() if arch in supported_architectures()]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The engines root every load in this module uses (Engine.load reads $EDGEINFER_ENGINES)."""
    root = tmp_path_factory.mktemp("engines")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEINFER_ENGINES", str(root))
        yield root


def config(**overrides) -> EngineConfig:
    return EngineConfig(**{"num_blocks": 256, **overrides})


def tokens(engine: Engine, questions) -> list[list[int]]:
    return [engine.generate(q, images, FORCED).token_ids for q, images in questions]


@pytest.fixture(scope="module")
def smolvlm_reference(checkpoint):
    return tokens(Engine.load(checkpoint("smolvlm"), config=config()), QUESTIONS)


# --------------------------------------------------------------------------- export


def test_build_writes_checked_graphs_and_manifest(checkpoint, engines):
    path = checkpoint("smolvlm")
    result = build_engines(load_model(path), BuildSpec.custom("export"), engines, progress=False)
    folder, manifest = result.folder, result.manifest.to_json()
    assert folder == engines / path.name / "export" and not result.skipped
    for name in (VISION_FILE, DECODER_FILE):
        onnx.checker.check_model(str(folder / name), full_check=True)
        assert onnx.load(str(folder / name)).opset_import[0].version == OPSET
    # The tower's attention is an additive mask and a softmax: the mask is built once, and no
    # layer runs a Where / IsNaN over its scores.
    layer_ops = Counter(node.op_type for node in onnx.load(str(folder / VISION_FILE)).graph.node
                        if "/encoder/layers." in node.name)
    assert layer_ops["Softmax"] == 2 and layer_ops["IsNaN"] == layer_ops["Where"] == 0, layer_ops
    fingerprint = manifest["fingerprint"]
    assert fingerprint["tensorrt"] is None and fingerprint["sm"] is None and fingerprint["profile"] is None
    assert set(fingerprint["onnx"]) == {VISION_FILE, DECODER_FILE}
    assert fingerprint["model"] == checkpoint_fingerprint(path)
    assert manifest["model"] == path.name and manifest["model_dir"] == str(path.resolve())
    assert {"torch", "onnx", "onnxruntime", "transformers"} <= set(manifest["versions"])
    decoder = manifest["engines"]["decoder"]
    assert list(decoder["inputs"]) == ["inputs_embeds", "position_ids", "k_pool", "v_pool", "block_tables",
                                       "context_lens"]
    assert decoder["inputs"]["k_pool"]["shape"][1:3] == ["blocks", "block_size"]
    assert decoder["outputs"]["new_k"]["shape"][1:3] == ["batch", "tokens"]
    assert manifest["checks"]["vision"]["max_abs_diff"] < 1e-4
    assert json.loads((folder / MANIFEST).read_text()) == manifest


def test_decoder_graph_matches_the_torch_step_on_other_shapes(checkpoint, engines):
    """Batch, new tokens, table width, pool size and block size all differ from the export example."""
    from edgeinfer.backends.onnx.export import cpu_session

    model = load_model(checkpoint("smolvlm"))
    folder = build_engines(model, BuildSpec.custom("export"), engines, progress=False).folder
    session = cpu_session(folder / DECODER_FILE)
    for case in (dict(batch=3, tokens=1, context=[17, 4, 1], block_size=8, num_blocks=40),
                 dict(batch=1, tokens=9, context=[0], block_size=32, num_blocks=3),
                 dict(batch=2, tokens=2, context=[30, 7], block_size=1, num_blocks=64)):
        inputs = decoder_example(model.decoder, **case)
        with torch.no_grad():
            expected = model.decoder(**inputs)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        for g, e in zip(got, expected):
            assert g.shape == tuple(e.shape)
            np.testing.assert_allclose(g, e.numpy(), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- token parity


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_the_torch_backend(checkpoint, engines, family):
    path = checkpoint(family)
    questions = QUESTIONS[:2] if family != "smolvlm" else QUESTIONS
    expected = tokens(Engine.load(path, config=config()), questions)
    engine = Engine.load(path, backend="onnxruntime", config=config())
    assert engine.backend == "onnxruntime"
    assert type(engine.vision_engine).__name__ == "OrtVisionEngine", "every family's vision runs on ORT"
    assert tokens(engine, questions) == expected
    assert any(len(set(t)) > 1 for t in expected), "constant sequences would make this comparison meaningless"


def test_batched_decode_matches_each_alone(checkpoint, engines, smolvlm_reference):
    engine = Engine.load(checkpoint("smolvlm"), backend="onnxruntime", config=config(max_batch_size=4))
    seqs = [engine.submit(q, images, FORCED) for q, images in QUESTIONS]
    batch_sizes = []
    while engine.has_work():
        batch_sizes.append(len(engine.step()))
    assert max(batch_sizes) == len(QUESTIONS), "the sequences must share decode steps"
    assert [engine.result(s).token_ids for s in seqs] == smolvlm_reference


def test_spilling_and_preemption_keep_tokens(checkpoint, engines, smolvlm_reference, tmp_path):
    """30 four-token blocks hold about one and a half of the four sequences: the KV manager preempts
    and spills to host and disk tiers; restored blocks land in the pool the graph reads by pointer."""
    engine = Engine.load(checkpoint("smolvlm"), backend="onnxruntime", config=config(
        block_size=4, num_blocks=30, max_batch_size=4, high_watermark=0.4, low_watermark=0.2, host_tier_mb=1,
        disk_tier_mb=4, disk_dir=str(tmp_path)))
    results = engine.run_until_done([engine.submit(q, images, FORCED) for q, images in QUESTIONS])
    counters = engine.counters
    engine.close()
    assert counters["preemptions"] >= 1 and counters["spilled_blocks"] >= 4 and counters["restored_blocks"] >= 10
    assert [r.token_ids for r in results] == smolvlm_reference


def test_pools_are_bound_by_reference(checkpoint, engines):
    """A write into the pool after a step is what the next step reads, with no rebinding or copy."""
    model = load_model(checkpoint("smolvlm"))
    ort_engines = open_engines(model, config(profile_name="export"), engines, announce=False)
    inputs = decoder_example(model.decoder, batch=1, tokens=1, block_size=16, context=[12])
    first = ort_engines.decoder.step(**inputs)[0].clone()
    inputs["k_pool"].mul_(2.0)  # in place: same memory, new values
    second = ort_engines.decoder.step(**inputs)[0]
    with torch.no_grad():
        expected = model.decoder(**inputs)[0]
    assert not torch.allclose(first, second)
    torch.testing.assert_close(second, expected, atol=1e-4, rtol=1e-4)


def test_the_graph_reads_the_pools_only_through_gathers(checkpoint, engines):
    """No op copies a pool: each is flattened (a view in ORT) and gathered by block, never sliced by layer."""
    folder = build_engines(load_model(checkpoint("smolvlm")), BuildSpec.custom("export"), engines,
                           progress=False).folder
    nodes = onnx.load(str(folder / DECODER_FILE)).graph.node
    consumers = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for pool in ("k_pool", "v_pool"):
        views = [n for n in consumers[pool] if n.op_type != "Shape"]  # Shape reads no data
        assert views and {n.op_type for n in views} <= {"Flatten", "Reshape"}, [n.op_type for n in views]
        assert all(c.op_type == "Gather" for view in views for c in consumers[view.output[0]])


def test_the_layers_hold_no_shape_arithmetic_and_never_copy_the_past_whole(checkpoint, engines):
    """Every reshape inside a layer has a constant shape: no Shape op runs per layer per step.
    The past is read as gathered, with the new tokens' rows written over their slots: no
    layer concatenates or transposes it (ONNX Runtime pays per node and per copy)."""
    folder = build_engines(load_model(checkpoint("smolvlm")), BuildSpec.custom("export"), engines,
                           progress=False).folder
    nodes = [n for n in onnx.load(str(folder / DECODER_FILE)).graph.node if n.op_type != "Constant"]
    in_layers = [n for n in nodes if "/layers." in n.name]
    assert in_layers and not [n.name for n in in_layers if n.op_type == "Shape"]
    assert not [n.name for n in in_layers if n.op_type == "Concat"]
    layers = len({n.name.split("/layers.")[1].split("/")[0] for n in in_layers})
    # Of the past, one transpose a layer: the keys' last two axes in q @ k^T, which ORT folds into
    # the product. The others move the new tokens' rows only (q, the new K/V, the output).
    producer = {out: n for n in nodes for out in n.output}
    transposes = [n for n in in_layers if n.op_type == "Transpose"]
    of_past = [n for n in transposes if producer[n.input[0]].op_type in ("Gather", "ScatterND")]
    assert len(of_past) == layers and all(producer[n.input[0]].op_type == "ScatterND" for n in of_past)
    assert len(transposes) <= 5 * layers
    assert len(in_layers) / layers < 55, f"{len(in_layers) / layers:.0f} nodes a layer"


# --------------------------------------------------------------------------- manifest: skip, stale, corrupt


def test_rebuild_is_skipped_while_the_manifest_matches(checkpoint, engines):
    model = load_model(checkpoint("smolvlm"))
    spec = BuildSpec.custom("skip")
    first = build_engines(model, spec, engines, progress=False)
    stamp = (first.folder / DECODER_FILE).stat().st_mtime_ns
    again = build_engines(model, spec, engines, progress=False)
    assert again.skipped and again.manifest == first.manifest
    assert (first.folder / DECODER_FILE).stat().st_mtime_ns == stamp


def test_stale_and_corrupt_artifacts_are_named(checkpoint, engines):
    from edgeinfer.profiles import load_profile

    path = checkpoint("smolvlm")
    model, model_fp = load_model(path), checkpoint_fingerprint(path)
    spec = BuildSpec.from_profile(load_profile("cpu"))
    folder = build_engines(model, spec, engines, progress=False).folder
    assert engine_problems(folder, spec, model_fp) == []

    changed = BuildSpec.from_profile(load_profile("cpu", ["runtime.max_batch_size=1"]))
    assert any("profile 'cpu' changed" in r for r in engine_problems(folder, changed, model_fp))
    assert any("precision fp32 -> int8" in r for r in engine_problems(folder, BuildSpec.from_profile(
        load_profile("cpu"), "int8"), model_fp))
    assert any("model fingerprint" in r for r in engine_problems(folder, spec, "0" * 64))

    decoder = folder / DECODER_FILE
    data = bytearray(decoder.read_bytes())
    data[len(data) // 2] ^= 0xFF
    decoder.write_bytes(bytes(data))
    problems = engine_problems(folder, spec, model_fp)
    assert problems == [f"{decoder}: corrupt or changed (sha256 differs from the manifest)"]
    rebuilt = build_engines(model, spec, engines, progress=False)
    assert not rebuilt.skipped and rebuilt.reasons == tuple(problems)
    assert engine_problems(folder, spec, model_fp) == []

    older = json.loads((folder / MANIFEST).read_text()) | {"export_revision": 1}
    (folder / MANIFEST).write_text(json.dumps(older))
    assert any("export revision 1" in r for r in engine_problems(folder, spec, model_fp))

    (folder / MANIFEST).write_text("{not json")
    (problem,) = engine_problems(folder, spec, model_fp)
    assert str(folder / MANIFEST) in problem and "corrupt manifest" in problem


def test_engine_load_rebuilds_a_corrupt_build(checkpoint, engines, capfd):
    path = checkpoint("smolvlm")
    Engine.load(path, backend="onnxruntime", config=config(profile_name="heal"))
    folder = engines / path.name / "heal"
    (folder / VISION_FILE).write_bytes(b"truncated")
    engine = Engine.load(path, backend="onnxruntime", config=config(profile_name="heal"))
    assert f"{folder / VISION_FILE}: corrupt or changed" in capfd.readouterr().err
    assert engine.generate(*QUESTIONS[0], SamplingParams(max_new_tokens=2)).token_ids


def test_missing_build_names_the_build_command(checkpoint, engines):
    model = load_model(checkpoint("smolvlm"))
    with pytest.raises(EngineBuildError, match="edgeinfer build --backend onnxruntime --model .* --profile never"):
        open_engines(model, config(profile_name="never"), engines)


def test_doctor_accepts_the_manifest(checkpoint, engines):
    from edgeinfer.device import detect_device
    from edgeinfer.doctor import check_engines, probe_environment
    from edgeinfer.profiles import load_profile

    build_engines(load_model(checkpoint("smolvlm")), BuildSpec.from_profile(load_profile("cpu")), engines,
                  progress=False)
    checks = check_engines(engines, probe_environment(), detect_device())
    assert checks and all(c.status == "pass" for c in checks), checks


# --------------------------------------------------------------------------- providers


def test_providers_follow_the_device_and_a_missing_one_is_an_error():
    assert select_providers("cpu", available=[CPU]) == [CPU]
    assert select_providers("cuda", available=[TENSORRT, CUDA, CPU]) == [TENSORRT, CPU]
    assert select_providers("cuda", available=[CUDA, CPU]) == [CUDA, CPU]
    with pytest.raises(BackendUnavailableError, match="CUDAExecutionProvider"):
        select_providers("cuda", available=[CPU])
    with pytest.raises(BackendUnavailableError, match="TensorrtExecutionProvider is not available"):
        select_providers("cpu", [TENSORRT], available=[CPU])


def test_requesting_an_absent_provider_fails_the_load(checkpoint, engines, monkeypatch):
    model = load_model(checkpoint("smolvlm"))
    build_engines(model, BuildSpec.custom("export"), engines, progress=False)
    with pytest.raises(BackendUnavailableError, match="CUDAExecutionProvider"):
        open_engines(model, config(profile_name="export"), engines, providers=[CUDA], announce=False)
    monkeypatch.setenv("EDGEINFER_ORT_PROVIDERS", TENSORRT)
    with pytest.raises(BackendUnavailableError, match="TensorrtExecutionProvider is not available"):
        Engine.load(checkpoint("smolvlm"), backend="onnxruntime", config=config(profile_name="export"))


# --------------------------------------------------------------------------- int8 and the CLI


def test_int8_quantizes_the_decoder_weights(checkpoint, engines):
    path = checkpoint("smolvlm")
    result = build_engines(load_model(path), BuildSpec.custom("int8", precision="int8"), engines, progress=False)
    decoder = result.manifest.engine("decoder").document
    assert decoder["precision"] == "int8" and decoder["quantization"]["weights"] == "int8 per channel"
    ops = {node.op_type for node in onnx.load(str(result.folder / DECODER_FILE)).graph.node}
    assert ops & {"MatMulInteger", "DynamicQuantizeMatMul"}
    fp32 = build_engines(load_model(path), BuildSpec.custom("export"), engines, progress=False)  # kept if built
    assert (result.folder / DECODER_FILE).stat().st_size < 0.8 * (fp32.folder / DECODER_FILE).stat().st_size
    engine = Engine.load(path, backend="onnxruntime", config=config(profile_name="int8"))
    assert len(engine.generate(*QUESTIONS[0], FORCED).token_ids) == FORCED.max_new_tokens


def test_an_int8_build_is_reused_and_a_stale_one_rebuilt_as_int8(checkpoint, engines, capfd):
    """A named onnxruntime backend runs the precision that was built, and builds only when that
    build is unusable; an int8 build is never replaced by an fp32 one."""
    path = checkpoint("smolvlm")
    folder = build_engines(load_model(path), BuildSpec.custom("kept", precision="int8"), engines,
                           progress=False).folder
    stamp = (folder / DECODER_FILE).stat().st_mtime_ns
    engine = Engine.load(path, backend="onnxruntime", config=config(profile_name="kept"))
    assert (engine.engines.backend, engine.engines.precision) == ("onnxruntime", "int8")
    assert (folder / DECODER_FILE).stat().st_mtime_ns == stamp
    (folder / DECODER_FILE).write_bytes(b"truncated")
    engine = Engine.load(path, backend="onnxruntime", config=config(profile_name="kept"))
    assert f"{folder / DECODER_FILE}: corrupt or changed" in capfd.readouterr().err
    assert engine.engines.precision == "int8" == read_manifest(folder).precision
    assert len(engine.generate(*QUESTIONS[0], FORCED).token_ids) == FORCED.max_new_tokens


def test_cli_builds_then_skips_and_maps_errors(checkpoint, tmp_path):
    from edgeinfer.cli.main import app

    runner = CliRunner()
    args = ["build", "--model", str(checkpoint("llava" if "llava" in FAMILIES else "smolvlm")),
            "--profile", "cpu", "--out", str(tmp_path), "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    built = json.loads(first.stdout)
    assert built["skipped"] is False and built["manifest"]["profile"] == "cpu"
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and json.loads(again.stdout)["skipped"] is True
    unavailable = runner.invoke(app, ["build", "--backend", "tensorrt", "--out", str(tmp_path)])
    assert unavailable.exit_code == BackendUnavailableError.exit_code
    bad = runner.invoke(app, args[:-1] + ["--set", "runtime.dtype=bfloat16"])
    assert bad.exit_code == EngineBuildError.exit_code and "runtime.dtype" in bad.output


# --------------------------------------------------------------------------- the demo model


def demo_model_dir():
    from edgeinfer.demo import DEMO_MODEL_DIR

    return DEMO_MODEL_DIR


def test_demo_model_int8_accuracy_and_fp32_parity(engines):
    from edgeinfer.demo import synthetic

    samples = synthetic.held_out(4321, 42)  # the demo model's own check seed, never trained on
    greedy = SamplingParams(max_new_tokens=4)

    roots = {}

    def answers(backend: str = "torch", overrides: tuple[str, ...] = ()) -> list[str]:
        # No disk tier: a persisted prefix or image embedding from another engine would skip the graphs.
        engine = Engine.load(demo_model_dir(), profile="cpu", backend=backend,
                             overrides=["memory.disk_tier_mb=0", *overrides])
        roots[(backend, overrides)] = engine.kv_manager.root
        return [engine.generate(s.question, [s.image], greedy).text.strip() for s in samples]

    torch_answers = answers()
    assert answers(backend="onnxruntime") == torch_answers
    int8 = answers(backend="onnxruntime", overrides=("build.precision=int8",))
    # Each engine's K/V gets prefix-cache keys of its own: int8 blocks are never served to fp32.
    assert len(set(roots.values())) == 3
    correct = sum(a == s.answer for a, s in zip(int8, samples))
    assert correct >= 0.95 * len(samples), list(zip(int8, [s.answer for s in samples]))
