"""Weight quantization of an exported decoder graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeinfer.backends.onnx.graphs import DECODER_OUTPUTS

# --------------------------------------------------------------------------- int8


def quantize_decoder(source: Path, target: Path, keep_head_fp32: bool = False) -> dict[str, Any]:
    """Dynamic int8 quantization of the decoder's MatMul weights, per output channel;
    activations stay float and are quantized per step. The vocabulary projection is
    quantized too unless ``keep_head_fp32``: at SmolVLM-256M's shapes it is a fifth of the
    weights, and a decode step on a CPU is bound by the bytes of weights it reads."""
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source), load_external_data=False)
    head = [n.name for n in model.graph.node if n.op_type == "MatMul" and DECODER_OUTPUTS[0] in n.output]
    excluded = head if keep_head_fp32 else []
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the quantizer advises its pre-processing pass on the root logger
    try:
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"], nodes_to_exclude=excluded,
                         use_external_data_format=(source.parent / (source.name + ".data")).is_file())
    finally:
        logging.disable(previous)
    return {"method": "onnxruntime.quantization.quantize_dynamic", "weights": "int8 per channel",
            "activations": "dynamic (per step)", "ops": ["MatMul"], "excluded": excluded,
            "vocab_projection": "fp32" if keep_head_fp32 else "int8"}


