"""Each family's vision graph: declared by its adapter, exported by the ONNX backend, accepted
by ``onnx.checker`` whatever torch traced it, and equal to the torch vision engine."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgeinfer.backends.onnx.export import check_graph, cpu_session, finalize_graph
from edgeinfer.errors import EngineBuildError


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
