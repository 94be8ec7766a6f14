"""ONNX export of the two graphs, the fixes and checks each exported file goes through.

TensorRT builds from the same graphs, so they keep a static rank, take int64 indices, use
no sequence ops and stay at opset 18.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeinfer.backends.onnx.graphs import (
    DECODER_OUTPUTS,
    VISION_OUTPUT,
    VisionGraph,
    decoder_axes,
    decoder_example,
    decoder_graph,
    decoder_inputs,
)
from edgeinfer.errors import EngineBuildError
from edgeinfer.models.decoder import Decoder

OPSET = 18
DECODER_FILE = "decoder.onnx"
VISION_FILE = "vision.onnx"
# protobuf refuses messages over 2 GiB: larger graphs keep their weights beside them.
EXTERNAL_DATA_BYTES = 1_800_000_000
# The name of a MatMul weight that is columns ``start:stop`` of a parameter (weight_slice_name).
WEIGHT_SLICE = re.compile(r"^(?P<parameter>.+)\[:,(?P<start>\d+):(?P<stop>\d+)\]$")


def sample_images(seed: int = 0) -> list:
    """Two noise pictures of different shapes: the export example and a second grid for the check."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((160, 120), (96, 200))]


def export_vision(graph: VisionGraph, example: dict[str, torch.Tensor], path: Path, opset: int = OPSET) -> None:
    feeds = graph.feeds(example)
    with graph.exporting(), torch.no_grad(), _quiet_exporter():
        torch.onnx.export(graph.module().eval(), tuple(feeds.values()), str(path), dynamo=False,
                          opset_version=opset, input_names=list(feeds), output_names=[VISION_OUTPUT],
                          dynamic_axes=graph.dynamic_axes())
    finalize_graph(path)


def export_decoder(decoder: Decoder, path: Path, block_size: int, opset: int = OPSET) -> None:
    example = decoder_example(decoder, batch=2, tokens=3, block_size=block_size, context=[5, 2])
    cfg = decoder.cfg
    module = decoder_graph(decoder).eval()
    with torch.no_grad(), _quiet_exporter():
        torch.onnx.export(module, tuple(example.values()), str(path), dynamo=False,
                          opset_version=opset, input_names=list(decoder_inputs(cfg)),
                          output_names=list(DECODER_OUTPUTS),
                          dynamic_axes=decoder_axes(cfg.mrope_section is not None, cfg.bidirectional_images))
    finalize_graph(path, parameters=dict(module.named_parameters()))


# --------------------------------------------------------------------------- graph hygiene


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The tracer warns at every Python value it freezes; the numerical checks after export
    are what tell whether a frozen value mattered."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def finalize_graph(path: Path, parameters: dict[str, torch.Tensor] | None = None) -> None:
    """Fix what the TorchScript exporter gets wrong, name the weights it folded out of a
    parameter's columns (:func:`name_weight_slices`, given the exported module's ``parameters``)
    and move large weights beside the graph.

    Some torch versions type an integer tensor float (a ``torch.full`` without a dtype). Two
    places then break: a Gather whose indices are float (it takes integers only) gets an
    exact Cast of its indices to int64, and a ScatterND whose ``updates`` differ in type
    from its ``data`` (which ``onnx.checker`` and ONNX Runtime refuse) gets its updates
    cast to the data's type. The checks after export say whether a cast value mattered.
    """
    import onnx

    model = onnx.load(str(path))
    # A repaired node can make the type of a later value known, hence a new pass until none repairs.
    while _repair_element_types(model, value_types(model)):
        pass
    if parameters:
        name_weight_slices(model, parameters)
    save_graph(model, path)


def weight_slice_name(parameter: str, start: int, stop: int) -> str:
    """The graph's name for columns ``start:stop`` of ``parameter`` (an ``[in, out]`` matrix):
    ``decoder.layers.0.qkv_t[:,0:64]``, the expression that slices it (:data:`WEIGHT_SLICE`)."""
    return f"{parameter}[:,{start}:{stop}]"


def name_weight_slices(model, parameters: dict[str, torch.Tensor]) -> dict[str, str]:
    """Rename each MatMul weight that the exporter folded out of columns of a parameter after
    those columns (:func:`weight_slice_name`); returns ``{old: new}``.

    Gemma 4's layers multiply by ``qkv_t[:, :q]`` and ``qkv_t[:, q:]`` (a layer sharing K/V
    has the q columns only); the exporter writes each slice as its own initializer named
    ``onnx::MatMul_<n>``, which says nothing of where it came from. A slice is found by value,
    the parameter's columns equal to the initializer bit for bit (the export is float32, so
    the folded slice holds the parameter's very values); where two parameters hold equal
    columns, each initializer takes a slice no other took. Every other weight already carries
    its parameter's name; the arithmetic of the graph does not change.
    """
    from onnx import numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    matrices = {name: p.detach().cpu().float().numpy() for name, p in parameters.items() if p.dim() == 2}
    renamed: dict[str, str] = {}
    for node in model.graph.node:
        source = node.input[1] if node.op_type == "MatMul" else None
        if source not in weights or source in matrices or source in renamed:
            continue
        found = [name for name in _column_slices(numpy_helper.to_array(weights[source]), matrices)
                 if name not in renamed.values()]
        if found:
            renamed[source] = found[0]
    for tensor in model.graph.initializer:
        tensor.name = renamed.get(tensor.name, tensor.name)
    for node in model.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    return renamed


def _column_slices(weight: np.ndarray, matrices: dict[str, np.ndarray]) -> Iterator[str]:
    """Names (:func:`weight_slice_name`) of the column ranges of ``matrices`` equal to ``weight``."""
    if weight.ndim != 2 or weight.dtype != np.float32:
        return
    rows, cols = weight.shape
    for name, matrix in matrices.items():
        if matrix.shape[0] != rows or matrix.shape[1] < cols:
            continue
        # Candidates by the first row (one pass over a vocabulary-wide head), then whole columns.
        starts = np.flatnonzero(matrix[0, :matrix.shape[1] - cols + 1] == weight[0, 0])
        yield from (weight_slice_name(name, int(c), int(c) + cols) for c in starts
                    if np.array_equal(matrix[:, c:c + cols], weight))


SCATTERS = ("ScatterND", "ScatterElements")


def _repair_element_types(model, types_: dict[str, int]) -> int:
    """Cast nodes put before the inputs whose element type breaks their node; returns how many."""
    from onnx import TensorProto

    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)
    nodes = []
    for node in model.graph.node:
        if node.op_type == "Gather" and types_.get(node.input[1]) in floats:
            nodes.append(_cast_input(node, 1, TensorProto.INT64, "index_to_int64"))
        if node.op_type in SCATTERS:
            data, updates = types_.get(node.input[0]), types_.get(node.input[2])
            if data and updates and data != updates:
                nodes.append(_cast_input(node, 2, data, "updates_to_data_type"))
        nodes.append(node)
    repaired = len(nodes) - len(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return repaired


def _cast_input(node, index: int, to: int, what: str):
    """A Cast node of ``node.input[index]`` to element type ``to``; ``node`` reads the cast value."""
    from onnx import helper

    source = node.input[index]
    cast = f"{source}_{what}"
    node.input[index] = cast
    return helper.make_node("Cast", [source], [cast], to=to, name=f"{node.name}_{what}")


def value_types(model) -> dict[str, int]:
    """Element type of every value, inferred on a copy whose weights are typed inputs
    without data (inference over the real model would copy every weight)."""
    import onnx
    from onnx import helper

    graph = model.graph
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer]
    light = helper.make_model(
        helper.make_graph(list(graph.node), "types", [*graph.input, *weights], list(graph.output)),
        opset_imports=list(model.opset_import))
    inferred = onnx.shape_inference.infer_shapes(light).graph
    return {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.input, *inferred.output]}


def save_graph(model, path: Path) -> None:
    import onnx

    external = model.ByteSize() > EXTERNAL_DATA_BYTES
    for stale in path.parent.glob(path.name + ".data"):
        stale.unlink()
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=path.name + ".data")


def graph_files(folder: Path, name: str) -> list[str]:
    """The graph file and its external weights, if any."""
    return [n for n in (name, name + ".data") if (folder / n).is_file()]


def check_graph(path: Path) -> None:
    import onnx
    import transformers

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        # What the exporter writes depends on these versions: the message names them.
        versions = f"torch {torch.__version__}, transformers {transformers.__version__}, onnx {onnx.__version__}"
        raise EngineBuildError(f"onnx.checker rejects the graph exported with {versions}: {exc}",
                               artifact=str(path)) from exc


def graph_io(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Names, element types and shapes (symbolic where dynamic) of a graph's inputs and outputs."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def describe(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            out[v.name] = {"dtype": onnx.TensorProto.DataType.Name(t.elem_type).lower(), "shape": dims}
        return out

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


# --------------------------------------------------------------------------- numerical checks


def cpu_session(path: Path, threads: int | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_decoder(decoder: Decoder, path: Path, block_size: int) -> dict[str, float]:
    """Largest differences between the graph and the torch decoder on a prefill and a batched decode step."""
    session = cpu_session(path)
    cases = {"prefill": {"batch": 1, "tokens": 6, "context": [0]},
             "prefill_after_past": {"batch": 1, "tokens": 4, "context": [9]},
             "batched_decode": {"batch": 3, "tokens": 1, "context": [11, 3, 1]}}
    report = {}
    for name, case in cases.items():
        inputs = decoder_example(decoder, block_size=block_size, seed=len(name), **case)
        with torch.no_grad():
            expected = decoder(**inputs)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        scale = float(expected[0].abs().max())
        report[name] = max(float((torch.from_numpy(g) - e).abs().max()) for g, e in zip(got, expected))
        report[name + "_argmax_equal"] = bool((torch.from_numpy(got[0]).argmax(-1) == expected[0].argmax(-1)).all())
        report["logit_scale"] = max(report.get("logit_scale", 0.0), scale)
    return report


def check_vision(graph: VisionGraph, adapter, path: Path) -> dict[str, float]:
    """Largest difference between the graph's embeddings and torch's on two pictures, the largest
    embedding (``scale``) and the lowest of the pictures' mean cosine similarity per embedding
    (``cosine``, which tells a quantized graph's error from a broken one)."""
    session = cpu_session(path)
    wanted = [i.name for i in session.get_inputs()]
    diffs, scale, cosine = [], 0.0, 1.0
    for image in sample_images():
        tensors = adapter.process_image(image).tensors
        with torch.no_grad():
            expected = graph.vision(**tensors).float()
        feeds = graph.feeds(tensors)
        output = torch.from_numpy(session.run(None, {k: feeds[k].numpy() for k in wanted})[0])
        got = graph.finish(output, tensors).float()
        if got.shape != expected.shape:
            raise EngineBuildError(f"vision graph gives {tuple(got.shape)} for an image torch encodes as "
                                   f"{tuple(expected.shape)}", artifact=str(path))
        diffs.append(float((got - expected).abs().max()))
        scale = max(scale, float(expected.abs().max()))
        rows = got.reshape(-1, got.shape[-1]), expected.reshape(-1, expected.shape[-1])
        cosine = min(cosine, float(torch.nn.functional.cosine_similarity(*rows, dim=-1).mean()))
    return {"max_abs_diff": max(diffs), "scale": scale, "cosine": cosine}


