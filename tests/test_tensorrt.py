"""TensorRT engines: the build planned as data on the ONNX graphs ONNX Runtime runs, the
memory guard and the fingerprint check without TensorRT; the real build and token parity
(marked ``tensorrt``) wherever TensorRT and a GPU are present."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from edgeinfer.backends.onnx.export import DECODER_FILE, VISION_FILE

from edgeinfer.artifacts import (
    MANIFEST,
    Expected,
    TensorRTFingerprint,
    TensorRTTarget,
    file_sha256,
    read_manifest,
    stale_reasons,
)
from edgeinfer.backends.onnx.build import GRAPH_FORMAT
from edgeinfer.backends.tensorrt.runtime import DecodeGraphPlan, ShapeLimits, clipped_buckets
from edgeinfer.backends.tensorrt.build import (
    DECODER_PLAN,
    VISION_PLAN,
    BuildMemoryError,
    BuildTarget,
    MemoryEstimate,
    check_build_memory,
    plan_build,
    plan_for_model,
    pool_blocks_for,
    read_graph,
    shapes_from_dim_ranges,
    shapes_from_samples,
    tensorrt_section,
    timing_cache_path,
    vision_samples,
)
from edgeinfer.errors import BackendUnavailableError, EngineBuildError, LimitExceeded
from edgeinfer.profiles import list_profiles, load_profile, profile_fingerprint

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
GIB = 2**30

# The machines each profile is for, as a build target would describe them.
ORIN = BuildTarget("10.3.0", "Orin (nvgpu)", "8.7", dla_cores=2, unified=True)
ORIN_NX_8GB = dataclasses.replace(ORIN, dla_cores=1)
ORIN_NANO = dataclasses.replace(ORIN, dla_cores=0)
THOR = BuildTarget("10.13.3", "NVIDIA Thor", "11.0", dla_cores=0, unified=True)
H200 = BuildTarget("10.13.3", "NVIDIA H200", "9.0", unified=False)
TARGETS = {"agx-orin-32gb": ORIN, "agx-orin-64gb": ORIN, "orin-nx-16gb": ORIN, "orin-nx-8gb": ORIN_NX_8GB,
           "orin-nano-8gb": ORIN_NANO, "orin-nano-4gb": ORIN_NANO, "agx-thor": THOR, "cuda": H200, "cpu": H200}
# build.precision + runtime.dtype of each profile -> builder flags.
FLAGS = {"agx-orin-32gb": ("FP16", "BF16"), "agx-orin-64gb": ("FP16", "BF16"), "orin-nx-16gb": ("FP16", "BF16"),
         "orin-nx-8gb": ("FP16", "BF16"), "orin-nano-8gb": ("FP16", "BF16"), "orin-nano-4gb": ("FP16", "BF16"),
         "agx-thor": ("BF16",), "cuda": ("FP16",), "cpu": ()}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def plan_of(exported_graphs, family: str, profile, target: BuildTarget, tmp_path):
    model, folder = exported_graphs(family)
    return plan_for_model(model, profile, folder, target, tmp_path)


# --------------------------------------------------------------------------- the plan of every profile


def test_shipped_profiles_all_have_a_target_here():
    assert set(TARGETS) == set(list_profiles())


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_build_plan_of_each_profile(exported_graphs, tmp_path, name):
    profile = load_profile(name)
    model, folder = exported_graphs("smolvlm")
    plan = plan_for_model(model, profile, folder, TARGETS[name], tmp_path)
    build, cfg = profile.build, model.decoder.cfg
    assert plan.profile == name and plan.profile_fingerprint == profile_fingerprint(profile)

    # decoder: every input of the graph, shapes straight from the profile
    b, t, w = build.decoder_batch, build.decoder_tokens, build.decoder_block_table
    bs, layers, kvh, hd, hidden = profile.kv.block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    blocks = profile.memory.kv_device_budget_mb * 2**20 // (2 * layers * bs * kvh * hd * ITEMSIZE[profile.runtime.dtype])
    assert pool_blocks_for(profile, cfg) == blocks
    decoder = plan.decoder
    expected = {
        "inputs_embeds": ((b.min, t.min, hidden), (b.opt, t.opt, hidden), (b.max, t.max, hidden)),
        "position_ids": ((b.min, t.min), (b.opt, t.opt), (b.max, t.max)),
        "k_pool": ((layers, 1, bs, kvh, hd), (layers, blocks, bs, kvh, hd), (layers, blocks, bs, kvh, hd)),
        "v_pool": ((layers, 1, bs, kvh, hd), (layers, blocks, bs, kvh, hd), (layers, blocks, bs, kvh, hd)),
        "block_tables": ((b.min, w.min), (b.opt, w.opt), (b.max, w.max)),
        "context_lens": ((b.min,), (b.opt,), (b.max,)),
    }
    assert {s.name: (s.min, s.opt, s.max) for s in decoder.shapes} == expected
    assert decoder.flags == FLAGS[name] and decoder.precision == build.precision
    assert decoder.cleared_flags == (("TF32",) if build.precision == "fp32" else ())  # fp32 means fp32
    assert decoder.workspace_bytes == build.workspace_mb * 2**20
    assert decoder.optimization_level == build.builder_optimization_level
    assert decoder.dla_core is None and decoder.plan_file == DECODER_PLAN
    float_io = {} if profile.runtime.dtype == "float32" else {
        n: profile.runtime.dtype for n in ("inputs_embeds", "k_pool", "v_pool", "logits", "new_k", "new_v")}
    assert dict(decoder.io_dtypes) == float_io
    cache = timing_cache_path(tmp_path, TARGETS[name]) if build.timing_cache else None
    assert decoder.timing_cache == (cache if cache else None)

    # vision: SmolVLM tiles (5 per picture for this checkpoint at every side) times vision_batch
    vision, v = plan.vision, build.vision_batch
    assert {s.name: (s.min, s.opt, s.max) for s in vision.shapes} == {
        "pixel_values": ((5 * v.min, 3, 64, 64), (5 * v.opt, 3, 64, 64), (5 * v.max, 3, 64, 64)),
        "patch_attention_mask": ((5 * v.min, 16), (5 * v.opt, 16), (5 * v.max, 16)),
        "patch_position_ids": ((5 * v.min, 16), (5 * v.opt, 16), (5 * v.max, 16))}
    # its I/O stays float32 (pixels in, embeddings out), so only build.precision sets flags
    assert vision.flags == {"fp16": ("FP16",), "bf16": ("BF16",), "fp32": ()}[build.precision]
    assert vision.io_dtypes == () and vision.dla_core is None
    assert vision.workspace_bytes == build.workspace_mb * 2**20 and vision.plan_file == VISION_PLAN


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_dynamic_input_has_a_shape_and_static_dims_match(exported_graphs, tmp_path, name):
    _, folder = exported_graphs("smolvlm")
    plan = plan_of(exported_graphs, "smolvlm", load_profile(name), TARGETS[name], tmp_path)
    for engine, file in ((plan.decoder, DECODER_FILE), (plan.vision, VISION_FILE)):
        graph = read_graph(folder / file)
        assert [s.name for s in engine.shapes] == [i.name for i in graph.inputs]
        for value in graph.inputs:
            shape = engine.shape(value.name)
            assert len(shape.min) == len(shape.opt) == len(shape.max) == len(value.dims)
            for axis, dim in enumerate(value.dims):
                low, opt, high = shape.min[axis], shape.opt[axis], shape.max[axis]
                assert 1 <= low <= opt <= high, (value.name, axis)
                if isinstance(dim, int) and dim > 0:
                    assert low == opt == high == dim, (value.name, axis)


FAMILIES = ["smolvlm", "idefics3", "qwen2_vl", "qwen2_5_vl", "llava", "llava_next"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_graph_gets_a_complete_plan(exported_graphs, tmp_path, family):
    model, folder = exported_graphs(family)
    plan = plan_for_model(model, load_profile("agx-orin-64gb"), folder, ORIN, tmp_path)
    assert plan.vision is not None, f"{family} has no vision graph"
    for engine, file in ((plan.decoder, DECODER_FILE), (plan.vision, VISION_FILE)):
        graph = read_graph(folder / file)
        assert [s.name for s in engine.shapes] == [i.name for i in graph.inputs]
        for value in graph.inputs:
            shape = engine.shape(value.name)
            for axis, dim in enumerate(value.dims):
                assert 1 <= shape.min[axis] <= shape.opt[axis] <= shape.max[axis], (value.name, axis)
                if isinstance(dim, int) and dim > 0:
                    assert shape.min[axis] == shape.max[axis] == dim, (value.name, axis)


def test_qwen2_vl_plan_has_mrope_positions_and_measured_patch_counts(exported_graphs, tmp_path):
    profile = load_profile("orin-nano-8gb")  # vision_side 224/448/1280, vision_batch 1/1/2
    plan = plan_of(exported_graphs, "qwen2_vl", profile, ORIN_NANO, tmp_path)
    b, t = profile.build.decoder_batch, profile.build.decoder_tokens
    positions = plan.decoder.shape("position_ids")
    assert (positions.min, positions.opt, positions.max) == ((3, b.min, t.min), (3, b.opt, t.opt), (3, b.max, t.max))
    # This checkpoint's processor: a 28 px picture (the smallest preflight admits) is 64
    # patches, 224 px and up is 256 (its max_pixels); two pictures give twice the patches
    # and three segment bounds.
    shapes = {s.name: (s.min, s.opt, s.max) for s in plan.vision.shapes}
    assert shapes == {"pixel_values": ((64, 1176), (256, 1176), (512, 1176)),
                      "position_ids": ((64, 2), (256, 2), (512, 2)),
                      "cu_seqlens": ((2,), (2,), (3,))}


def test_demo_model_plan(exported_graphs, tmp_path):
    profile = load_profile("cuda")  # vision_batch 1/1/6
    plan = plan_of(exported_graphs, "demo", profile, H200, tmp_path)
    pixels = plan.vision.shape("pixel_values")
    assert (pixels.min, pixels.opt, pixels.max) == ((1, 3, 128, 128), (1, 3, 128, 128), (6, 3, 128, 128))
    assert plan.decoder.flags == ("FP16",) and plan.vision.flags == ("FP16",)


def test_a_dim_no_range_covers_and_a_static_mismatch_are_refused(exported_graphs):
    _, folder = exported_graphs("smolvlm")
    decoder, vision = read_graph(folder / DECODER_FILE), read_graph(folder / VISION_FILE)
    ranges = {"batch": (1, 1, 2), "tokens": (1, 1, 8), "block_size": (16,) * 3, "blocks": (1, 8, 8)}
    with pytest.raises(EngineBuildError, match="'block_tables' has a dynamic dim 1 \\(table\\)"):
        shapes_from_dim_ranges(decoder, ranges)
    wrong = {"pixel_values": (5, 3, 32, 32), "patch_attention_mask": (5, 4), "patch_position_ids": (5, 4)}
    with pytest.raises(EngineBuildError, match="'pixel_values' dim 2 is 64 in the graph, fed 32"):
        shapes_from_samples(vision, {"min": [wrong], "opt": [wrong], "max": [wrong]})


# --------------------------------------------------------------------------- precision and DLA


def test_int8_and_fp8_need_scales_the_exported_graph_lacks(exported_graphs, tmp_path):
    for precision in ("int8", "fp8"):
        profile = load_profile("cuda", [f"build.precision={precision}"])
        with pytest.raises(EngineBuildError, match="QuantizeLinear/DequantizeLinear") as error:
            plan_of(exported_graphs, "smolvlm", profile, H200, tmp_path)
        assert error.value.exit_code == 6 and "build.precision=fp16" in str(error.value)


def test_int8_with_a_qdq_graph_sets_int8(exported_graphs, tmp_path):
    _, folder = exported_graphs("smolvlm")
    qdq = dataclasses.replace(read_graph(folder / DECODER_FILE), has_qdq=True)
    profile = load_profile("cuda", ["build.precision=int8"])
    plan = plan_build(profile, H200, qdq, None, None, pool_blocks=64, root=tmp_path)
    assert plan.decoder.flags == ("INT8", "FP16") and plan.vision is None


def test_bf16_needs_ampere(exported_graphs, tmp_path):
    turing = BuildTarget("10.13.3", "Tesla T4", "7.5")
    with pytest.raises(EngineBuildError, match="bf16 needs a GPU of SM 8.0 or newer, Tesla T4 is SM 7.5"):
        plan_of(exported_graphs, "smolvlm", load_profile("agx-thor"), turing, tmp_path)


def test_dla_for_the_vision_engine_only_with_gpu_fallback(exported_graphs, tmp_path):
    profile = load_profile("orin-nx-16gb", ["build.dla_core=1"])
    plan = plan_of(exported_graphs, "smolvlm", profile, ORIN, tmp_path)
    assert plan.vision.dla_core == 1 and plan.vision.flags == ("FP16", "GPU_FALLBACK")
    assert plan.decoder.dla_core is None and "GPU_FALLBACK" not in plan.decoder.flags
    with pytest.raises(EngineBuildError, match="Orin \\(nvgpu\\) has 0") as error:
        plan_of(exported_graphs, "smolvlm", load_profile("orin-nano-8gb", ["build.dla_core=0"]), ORIN_NANO,
                tmp_path)
    assert "build.dla_core=null" in str(error.value)


def test_timing_cache_is_one_file_per_tensorrt_version_and_gpu(tmp_path):
    assert timing_cache_path(tmp_path, ORIN) == tmp_path / "timing-cache" / "tensorrt-10.3.0-sm87-orin-nvgpu.cache"
    assert timing_cache_path(tmp_path, THOR) != timing_cache_path(tmp_path, H200)
    assert load_profile("cpu").build.timing_cache is False


# --------------------------------------------------------------------------- the memory guard


def test_memory_estimate_adds_weights_conversion_and_workspace():
    fp16 = MemoryEstimate.of(4 * GIB, "fp16", GIB, unified=True)
    assert (fp16.host_bytes, fp16.device_bytes) == (6 * GIB, 3 * GIB)
    fp32 = MemoryEstimate.of(4 * GIB, "fp32", GIB, unified=False)
    assert (fp32.host_bytes, fp32.device_bytes) == (8 * GIB, 5 * GIB)


def test_memory_guard_refuses_before_the_build(exported_graphs, tmp_path):
    profile = load_profile("orin-nano-8gb")  # workspace 1024 MiB, fp16
    _, folder = exported_graphs("smolvlm")
    weights = read_graph(folder / DECODER_FILE).weight_bytes
    needed_mb = -(-(weights + weights // 2 + weights // 2 + 1024 * 2**20) // 2**20)
    tight = dataclasses.replace(ORIN_NANO, host_available_bytes=512 * 2**20)
    plan = plan_of(exported_graphs, "smolvlm", profile, tight, tmp_path)
    with pytest.raises(BuildMemoryError) as error:
        check_build_memory(plan)
    message = str(error.value)
    assert error.value.exit_code == 6 and error.value.available_mb == 512
    assert "needs about" in message and "MiB of shared (unified) memory, 512 MiB is available" in message
    assert abs(plan.decoder.memory.total_bytes / 2**20 - needed_mb) <= 1
    check_build_memory(plan_of(exported_graphs, "smolvlm", profile,
                               dataclasses.replace(ORIN_NANO, host_available_bytes=8 * GIB), tmp_path))


def test_memory_guard_on_a_discrete_gpu_checks_gpu_memory(exported_graphs, tmp_path):
    target = dataclasses.replace(H200, host_available_bytes=64 * GIB, device_available_bytes=256 * 2**20)
    plan = plan_of(exported_graphs, "smolvlm", load_profile("cuda"), target, tmp_path)  # workspace 4 GiB
    with pytest.raises(BuildMemoryError, match="of GPU memory, 256 MiB is available"):
        check_build_memory(plan)


# --------------------------------------------------------------------------- the fingerprint


@pytest.fixture
def built_folder(exported_graphs, tmp_path):
    """A copy of the exported graphs, recorded as built for the cuda profile, with a TensorRT
    section; the plan files hold bytes that stand in for engines here: the check reads only
    their hashes, it never runs them. Returns the folder and what this machine expects of it."""
    _, source = exported_graphs("smolvlm")
    folder = tmp_path / "smolvlm" / "cuda"
    shutil.copytree(source, folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    profile = load_profile("cuda")
    plan = plan_of(exported_graphs, "smolvlm", profile, H200, tmp_path)
    manifest["profile"], manifest["fingerprint"]["profile"] = "cuda", profile_fingerprint(profile)
    fingerprint = TensorRTFingerprint(H200.tensorrt, H200.gpu, H200.sm, profile_fingerprint(profile),
                                    manifest["fingerprint"]["onnx"], plan.decoder.shape("k_pool").max[1])
    plans = {}
    for name in (VISION_PLAN, DECODER_PLAN):
        (folder / name).write_bytes(name.encode() * 64)
        plans[name] = file_sha256(folder / name)
    manifest["tensorrt"] = tensorrt_section(plan, fingerprint, plans, {"vision": 1.0, "decoder": 2.0})
    (folder / MANIFEST).write_text(json.dumps(manifest))
    machine = TensorRTTarget(H200.tensorrt, H200.gpu, H200.sm, fingerprint.pool_blocks)
    return folder, Expected("cuda", profile_fingerprint(profile), graphs=GRAPH_FORMAT, tensorrt=machine)


def test_fingerprint_accepts_its_own_build(built_folder):
    folder, expected = built_folder
    assert stale_reasons(read_manifest(folder), expected) == []


@pytest.mark.parametrize(("change", "reason"), [
    ({"tensorrt": "10.4.0"}, "built with TensorRT 10.13.3, this machine has 10.4.0"),
    ({"gpu": "NVIDIA H100 80GB HBM3"}, "built with GPU NVIDIA H200, this machine has NVIDIA H100 80GB HBM3"),
    ({"sm": "8.9"}, "built with GPU SM 9.0, this machine has 8.9"),
    ({"pool_blocks": 4}, "built for a KV pool of 1048576 blocks, this one has 4"),
])
def test_fingerprint_refuses_stale_engines(built_folder, change, reason):
    folder, expected = built_folder
    machine = dataclasses.replace(expected.tensorrt, **change)
    assert stale_reasons(read_manifest(folder), dataclasses.replace(expected, tensorrt=machine)) == [reason]


def test_fingerprint_refuses_another_profile_and_other_graphs(built_folder):
    folder, expected = built_folder
    other = dataclasses.replace(expected, profile_fingerprint="0" * 16)
    assert stale_reasons(read_manifest(folder), other) == ["profile 'cuda' changed since the build"]
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["tensorrt"]["fingerprint"]["onnx"][DECODER_FILE] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert stale_reasons(read_manifest(folder), expected) == ["built from other ONNX graphs (ONNX hash changed)"]


def test_fingerprint_refuses_corrupt_missing_and_absent_engines(built_folder):
    folder, expected = built_folder
    plan = folder / DECODER_PLAN
    data = bytearray(plan.read_bytes())
    data[3] ^= 0xFF
    plan.write_bytes(bytes(data))
    assert stale_reasons(read_manifest(folder), expected) == [
        f"{plan}: corrupt or changed (sha256 differs from the manifest)"]
    (folder / VISION_PLAN).unlink()
    assert f"{folder / VISION_PLAN}: missing" in stale_reasons(read_manifest(folder), expected)
    manifest = read_manifest(folder)
    assert stale_reasons(dataclasses.replace(manifest, tensorrt=None), expected) == ["no TensorRT engines built"]
    old = dataclasses.replace(manifest, tensorrt=dataclasses.replace(manifest.tensorrt, schema=0))
    assert "schema 0" in stale_reasons(old, expected)[0]


def test_manifest_section_keeps_the_plan_as_data(built_folder):
    folder, _ = built_folder
    section = json.loads((folder / MANIFEST).read_text())["tensorrt"]
    assert set(section["engines"]) == {"vision", "decoder"}
    decoder = section["engines"]["decoder"]
    assert decoder["shapes"]["block_tables"] == {"min": [1, 1], "opt": [4, 128], "max": [8, 512]}
    assert decoder["flags"] == ["FP16"] and decoder["workspace_bytes"] == 4096 * 2**20


def test_shape_limits_name_the_profile_field():
    limits = ShapeLimits({"block_tables": ((1, 1), (8, 512))})
    limits.check("block_tables", (8, 512), "build.decoder_block_table")
    with pytest.raises(LimitExceeded, match="block_tables dim 1 .* is 600, over the limit of 512") as error:
        limits.check("block_tables", (2, 600), "build.decoder_block_table")
    assert "build.decoder_block_table" in str(error.value)


# --------------------------------------------------------------------------- decode steps in CUDA graphs


def decoder_limits(plan) -> ShapeLimits:
    return ShapeLimits({s.name: (s.min, s.max) for s in plan.decoder.shapes})


def test_graph_buckets_are_the_torch_buckets_inside_the_built_range():
    assert clipped_buckets(1, 8) == (1, 2, 4, 8)
    assert clipped_buckets(1, 6) == (1, 2, 4, 6)  # the last bucket is the engine's max, not 8
    assert clipped_buckets(2, 8) == (2, 4, 8)  # nothing under the engine's min
    assert clipped_buckets(1, 512, start=8) == (8, 16, 32, 64, 128, 256, 512)
    assert clipped_buckets(1, 300, start=8) == (8, 16, 32, 64, 128, 256, 300)
    assert clipped_buckets(1, 4, start=8) == (4,)


def test_graph_plan_of_the_built_manifest(built_folder):
    folder, _ = built_folder
    limits = ShapeLimits.from_manifest(read_manifest(folder).tensorrt.engines["decoder"])
    plan = DecodeGraphPlan.for_engine(limits, enabled=True)  # cuda: batch 1..8, table 1..512
    assert plan.batches == (1, 2, 4, 8) and plan.widths == (8, 16, 32, 64, 128, 256, 512)
    assert not plan.mrope and plan.hidden == limits.ranges["inputs_embeds"][1][2]
    assert DecodeGraphPlan.for_engine(limits, enabled=False) is None  # runtime.cuda_graphs false


@pytest.mark.parametrize(("batch", "tokens", "width", "bucket"), [
    (1, 1, 1, (1, 8)),
    (3, 1, 20, (4, 32)),
    (8, 1, 512, (8, 512)),
    (1, 7, 4, None),  # prefill stays eager
    (2, 2, 4, None),
    (9, 1, 4, None),  # over every batch bucket
    (1, 1, 513, None),  # over every width bucket
])
def test_which_steps_replay_from_a_graph(built_folder, batch, tokens, width, bucket):
    folder, _ = built_folder
    limits = ShapeLimits.from_manifest(read_manifest(folder).tensorrt.engines["decoder"])
    assert DecodeGraphPlan.for_engine(limits, enabled=True).bucket(batch, tokens, width) == bucket


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_graph_shape_is_one_the_engine_takes(exported_graphs, tmp_path, name):
    profile = load_profile(name)
    limits = decoder_limits(plan_of(exported_graphs, "smolvlm", profile, TARGETS[name], tmp_path))
    plan = DecodeGraphPlan.for_engine(limits, enabled=True)
    assert plan.batches[-1] == profile.build.decoder_batch.max
    assert plan.widths[-1] == profile.build.decoder_block_table.max
    assert plan.bucket(profile.runtime.max_batch_size, 1, 1) is not None  # every decode batch has a graph
    for batch in plan.batches:
        for width in plan.widths:
            shapes = plan.input_shapes((batch, width))
            assert shapes["inputs_embeds"] == (batch, 1, plan.hidden) and shapes["context_lens"] == (batch,)
            assert shapes["position_ids"] == (batch, 1) and shapes["block_tables"] == (batch, width)
            for input_name, shape in shapes.items():
                limits.check(input_name, shape, "build")


def test_graph_plan_with_mrope_positions(exported_graphs, tmp_path):
    profile = load_profile("orin-nano-8gb")  # decoder_batch 1..2, table 1..256
    plan = DecodeGraphPlan.for_engine(decoder_limits(plan_of(exported_graphs, "qwen2_vl", profile, ORIN_NANO,
                                                             tmp_path)), enabled=True)
    assert plan.mrope and plan.batches == (1, 2) and plan.widths[-1] == 256
    assert plan.input_shapes((2, 16))["position_ids"] == (3, 2, 1)


def test_no_graphs_for_an_engine_without_single_token_steps():
    limits = ShapeLimits({"inputs_embeds": ((1, 2, 64), (4, 16, 64)), "position_ids": ((1, 2), (4, 16)),
                          "block_tables": ((1, 1), (4, 32)), "context_lens": ((1,), (4,))})
    assert DecodeGraphPlan.for_engine(limits, enabled=True) is None


# --------------------------------------------------------------------------- without TensorRT


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_cli_without_tensorrt_says_what_to_install(tmp_path):
    from edgeinfer.cli.main import app

    runner = CliRunner()
    for args in (["build", "--backend", "tensorrt", "--profile", "cuda", "--out", str(tmp_path)],
                 ["run", "what is this?", "--backend", "tensorrt", "--profile", "cuda"]):
        result = runner.invoke(app, args)
        assert result.exit_code == BackendUnavailableError.exit_code == 4, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "tensorrt" in lines[0] and "install" in lines[0], lines
    assert not any(tmp_path.iterdir())  # refused before any export


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_engine_load_without_tensorrt_is_backend_unavailable():
    from edgeinfer.demo import DEMO_MODEL_DIR
    from edgeinfer.engine import Engine

    with pytest.raises(BackendUnavailableError, match="'tensorrt'"):
        Engine.load(DEMO_MODEL_DIR, profile="cuda", backend="tensorrt")


# --------------------------------------------------------------------------- with TensorRT


def _needs_tensorrt():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed here (it ships with JetPack; "
                                           "pip install 'edgeinfer[tensorrt]' on a CUDA machine)")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT needs a CUDA GPU and torch sees none")


def _demo_answers(backend: str, overrides, samples):
    from edgeinfer.demo import DEMO_MODEL_DIR
    from edgeinfer.engine import Engine, SamplingParams

    engine = Engine.load(DEMO_MODEL_DIR, profile="cuda", backend=backend,
                         overrides=["memory.disk_tier_mb=0", *overrides])
    greedy = SamplingParams(max_new_tokens=8)
    return [engine.generate(s.question, [s.image], greedy).token_ids for s in samples]


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_tensorrt_builds_the_demo_engines_then_skips(tmp_path, monkeypatch):
    _needs_tensorrt()
    from edgeinfer.backends.tensorrt.build import build_tensorrt_engines
    from edgeinfer.demo import DEMO_MODEL_DIR

    profile = load_profile("cuda")
    first = build_tensorrt_engines(DEMO_MODEL_DIR, profile, tmp_path, progress=False)
    assert not first.skipped and (first.folder / VISION_PLAN).is_file() and (first.folder / DECODER_PLAN).is_file()
    section = first.manifest.tensorrt
    import tensorrt

    assert section.fingerprint.tensorrt == tensorrt.__version__
    assert section.fingerprint.sm == "{}.{}".format(*torch.cuda.get_device_capability(0))
    assert first.plan.decoder.timing_cache.is_file()  # written for the next build to reuse
    again = build_tensorrt_engines(DEMO_MODEL_DIR, profile, tmp_path, progress=False)
    assert again.skipped


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_tensorrt_tokens_match_torch_and_stale_engines_are_refused(tmp_path, monkeypatch):
    _needs_tensorrt()
    from edgeinfer.backends.tensorrt.build import build_tensorrt_engines
    from edgeinfer.demo import DEMO_MODEL_DIR, synthetic

    monkeypatch.setenv("EDGEINFER_ENGINES", str(tmp_path))
    exact = ["build.precision=fp32", "runtime.dtype=float32"]  # parity: no lowered precision
    result = build_tensorrt_engines(DEMO_MODEL_DIR, load_profile("cuda", exact), tmp_path, progress=False)
    samples = synthetic.held_out(4321, 8)
    assert _demo_answers("tensorrt", exact, samples) == _demo_answers("torch", exact, samples)

    manifest = result.manifest.to_json()
    manifest["tensorrt"]["fingerprint"]["tensorrt"] = "9.0.0"
    (result.folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineBuildError, match="edgeinfer build --backend tensorrt --model .* --profile cuda"):
        _demo_answers("tensorrt", exact, samples[:1])


def test_vision_samples_follow_the_profile_sides(exported_graphs):
    model, _ = exported_graphs("qwen2_vl")
    from edgeinfer.backends.onnx.graphs import vision_graph_for

    samples = vision_samples(vision_graph_for(model), model.adapter, load_profile("cuda"))
    assert [len(samples[k]) for k in ("min", "opt", "max")] == [2, 1, 1]
    assert samples["max"][0]["pixel_values"] == (6 * 256, 1176)  # vision_batch.max 6 at 256 patches each


def test_tensorrt_11_builds_only_float32_and_older_than_10_is_refused(exported_graphs, tmp_path):
    trt11 = dataclasses.replace(H200, tensorrt="11.4.0")
    with pytest.raises(EngineBuildError, match="strongly typed networks only") as error:
        plan_of(exported_graphs, "smolvlm", load_profile("cuda"), trt11, tmp_path)
    assert "use TensorRT 10.x" in str(error.value)
    fp32 = load_profile("cuda", ["build.precision=fp32", "runtime.dtype=float32"])
    plan = plan_of(exported_graphs, "smolvlm", fp32, trt11, tmp_path)
    assert plan.decoder.flags == () and plan.decoder.io_dtypes == ()
    with pytest.raises(EngineBuildError, match="older than 10.0"):
        plan_of(exported_graphs, "smolvlm", load_profile("agx-orin-64gb"),
                dataclasses.replace(ORIN, tensorrt="8.6.2"), tmp_path)


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_tensorrt_decode_graphs_give_the_eager_tokens(tmp_path, monkeypatch):
    _needs_tensorrt()
    from edgeinfer.backends.tensorrt.build import build_tensorrt_engines
    from edgeinfer.demo import DEMO_MODEL_DIR, synthetic
    from edgeinfer.engine import Engine, SamplingParams

    monkeypatch.setenv("EDGEINFER_ENGINES", str(tmp_path))
    exact = ["memory.disk_tier_mb=0", "build.precision=fp32", "runtime.dtype=float32"]
    build_tensorrt_engines(DEMO_MODEL_DIR, load_profile("cuda", exact), tmp_path, progress=False)
    samples = synthetic.held_out(4321, 4)
    greedy = SamplingParams(max_new_tokens=8)
    answers, graphs = {}, None
    # runtime.cuda_graphs is not in the profile fingerprint: both load the same engines.
    for flag in ("false", "true"):
        engine = Engine.load(DEMO_MODEL_DIR, profile="cuda", backend="tensorrt",
                             overrides=[*exact, f"runtime.cuda_graphs={flag}"])
        answers[flag] = [engine.generate(s.question, [s.image], greedy).token_ids for s in samples]
        graphs = engine.decoder_engine.graphs
    assert answers["true"] == answers["false"]
    assert graphs.error is None and graphs.graphs, graphs.error
    assert {batch for batch, _ in graphs.graphs} == {1}  # one request at a time: the batch-1 bucket
