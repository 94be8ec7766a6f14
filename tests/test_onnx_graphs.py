"""Each family's vision graph: declared by its adapter, exported by the ONNX backend, accepted
by ``onnx.checker`` whatever torch traced it, and equal to the torch vision engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from edgeinfer.backends.onnx.build import BuildSpec, build_engines
from edgeinfer.backends.onnx.export import (
    SCATTERS,
    VISION_FILE,
    check_graph,
    cpu_session,
    export_vision,
    finalize_graph,
    sample_images,
    value_types,
)
from edgeinfer.backends.onnx.graphs import vision_graph_for
from edgeinfer.errors import EngineBuildError
from edgeinfer.models.base import FamilyAdapter
from edgeinfer.models.export import VisionGraph
from edgeinfer.models.idefics3 import TiledVisionGraph, patch_position_ids
from edgeinfer.models.llava import AnyResVisionGraph
from edgeinfer.models.loader import load_model
from edgeinfer.models.qwen2_vl import QwenVisionGraph
from tests.conftest import noise_image

DECLARED = {"smolvlm": TiledVisionGraph, "idefics3": TiledVisionGraph, "llava": VisionGraph,
            "llava_next": AnyResVisionGraph, "qwen2_vl": QwenVisionGraph, "qwen2_5_vl": QwenVisionGraph}
TILED = ["smolvlm", "idefics3"]
IMAGES = [noise_image(160, 120, seed=1), noise_image(96, 200, seed=2), noise_image(40, 40, seed=3)]


@pytest.fixture(scope="module")
def loaded(checkpoint):
    models: dict[str, object] = {}

    def get(family: str):
        if family not in models:
            models[family] = load_model(checkpoint(family))
        return models[family]

    return get


@pytest.fixture(scope="module")
def tile_graph(loaded, tmp_path_factory):
    """family -> (model, graph, path of its vision graph exported as the build exports it)."""
    exported: dict[str, tuple] = {}

    def get(family: str):
        if family not in exported:
            model = loaded(family)
            graph = vision_graph_for(model)
            path = tmp_path_factory.mktemp(family) / VISION_FILE
            export_vision(graph, model.adapter.process_image(sample_images()[0]).tensors, path)
            exported[family] = (model, graph, path)
        return exported[family]

    return get


def padded_tiles(side: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three tiles as a processor pads pictures of different sizes into one batch: one whole,
    one with its lower right cut to 3/4 x 1/2, one a single row of patches high."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(3, side, side, dtype=torch.bool)
    mask[0] = True
    mask[1, : side * 3 // 4, : side // 2] = True
    mask[2, : side // 4, :] = True
    return {"pixel_values": torch.randn(3, 3, side, side, generator=gen), "pixel_attention_mask": mask}


# --------------------------------------------------------------------------- each family declares its graph


@pytest.mark.parametrize("family", sorted(DECLARED))
def test_each_family_declares_a_graph_that_encodes_as_its_vision_engine(loaded, family):
    """The graph's module and host steps, run in torch, give the vision engine's embeddings."""
    model = loaded(family)
    graph = vision_graph_for(model)
    assert type(graph) is DECLARED[family]
    assert graph is not None and graph.vision is model.vision
    for image in IMAGES[:2]:
        tensors = model.adapter.process_image(image).tensors
        feeds = graph.feeds(tensors)
        assert tuple(feeds) == graph.input_names
        with torch.no_grad():
            expected = model.vision(**tensors)
            with graph.exporting():
                output = graph.module().eval()(*feeds.values())
            got = graph.finish(output, tensors)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_family_without_a_graph_keeps_its_vision_engine_on_torch(loaded, tmp_path):
    model = loaded("smolvlm")

    class WithoutGraph(type(model.adapter)):
        vision_graph = FamilyAdapter.vision_graph  # the contract's default

    bare = dataclasses.replace(model, adapter=WithoutGraph(model.adapter.checkpoint))
    assert vision_graph_for(bare) is None
    result = build_engines(bare, BuildSpec.custom("without-graph"), tmp_path, progress=False)
    assert result.manifest.engines["vision"].runtime == "torch"
    assert not (result.folder / VISION_FILE).exists()


# --------------------------------------------------------------------------- SmolVLM / Idefics3 tiles


@pytest.mark.parametrize("family", TILED)
def test_patch_position_ids_are_those_of_the_transformers_embeddings(loaded, family):
    embeddings = loaded(family).vision.vision_model.embeddings
    side = embeddings.num_patches_per_side
    tensors = padded_tiles(embeddings.image_size)
    patch_mask = loaded(family).vision.patch_mask(tensors["pixel_attention_mask"])
    ids = patch_position_ids(patch_mask, side)
    assert ids.dtype == torch.int64 and ids.shape == (3, side * side)
    assert len({tuple(row) for row in ids.tolist()}) == 3, "each padding spreads the table differently"
    with torch.no_grad():
        expected = embeddings(tensors["pixel_values"], patch_attention_mask=patch_mask)
        patches = embeddings.patch_embedding(tensors["pixel_values"]).flatten(2).transpose(1, 2)
        got = patches + embeddings.position_embedding(ids)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", TILED)
def test_tile_graph_passes_the_full_check_with_no_mixed_type_scatter(tile_graph, family):
    _, _, path = tile_graph(family)
    onnx.checker.check_model(str(path), full_check=True)
    check_graph(path)
    model = onnx.load(str(path))
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    types = value_types(model)
    for node in model.graph.node:
        if node.op_type in SCATTERS:
            assert types[node.input[0]] == types[node.input[2]], f"{node.name}: data and updates types differ"
    inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    assert inputs == {"pixel_values": TensorProto.FLOAT, "patch_attention_mask": TensorProto.BOOL,
                      "patch_position_ids": TensorProto.INT64}


@pytest.mark.parametrize("family", TILED)
def test_tile_graph_in_onnxruntime_equals_torch(tile_graph, family):
    """Processed pictures (every patch real) and padded tiles (the position ids bucketed)."""
    model, graph, path = tile_graph(family)
    session = cpu_session(path)
    cases = [model.adapter.process_image(image).tensors for image in IMAGES]
    cases.append(padded_tiles(model.vision.vision_model.embeddings.image_size, seed=4))
    for tensors in cases:
        feeds = graph.feeds(tensors)
        got = session.run(None, {name: t.numpy() for name, t in feeds.items()})[0]
        with torch.no_grad():
            expected = model.vision(**tensors)
        assert got.shape == tuple(expected.shape)
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- repairs after export


def scatter_typed_apart(path) -> None:
    """The pattern the TorchScript exporter wrote for transformers 5.17's SmolVLM position ids:
    int64 ids scattered into zeros that ``torch.full`` without a dtype typed float, which then
    index a table. ``onnx.checker`` and ONNX Runtime refuse the scatter as it is."""
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                         value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("ScatterND", ["zeros", "where", "ids"], ["positions"], name="scatter"),
        helper.make_node("Gather", ["table", "positions"], ["rows"], name="lookup"),
    ]
    graph = helper.make_graph(
        nodes, "scatter_typed_apart",
        [helper.make_tensor_value_info("where", TensorProto.INT64, ["n", 1]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [4, 2])],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [1], [4]),
                     helper.make_tensor("table", TensorProto.FLOAT, [6, 2], table.flatten().tolist())])
    # IR version 8, as torch.onnx writes for opset 18 (older ONNX Runtimes refuse the newest IR).
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), str(path))


def test_finalize_repairs_a_scatter_whose_updates_are_typed_apart_from_its_data(tmp_path):
    path = tmp_path / "scatter.onnx"
    scatter_typed_apart(path)
    with pytest.raises(EngineBuildError, match="ScatterND"):
        check_graph(path)
    finalize_graph(path)
    check_graph(path)
    rows = cpu_session(path).run(None, {"where": np.array([[1], [3]]), "ids": np.array([5, 2])})[0]
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.testing.assert_array_equal(rows, table[[0, 5, 0, 2]])
