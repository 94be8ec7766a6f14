"""Low-bit weight formats, read as transforms of a loaded checkpoint (see docs/quantization.md)."""

from edgeinfer.quant.formats import (
    SUPPORTED,
    QuantMethod,
    QuantScheme,
    WeightScheme,
    parse_quant_config,
    read_quant_scheme,
)
from edgeinfer.quant.load import QuantizedCheckpoint, dequantize_tensors
from edgeinfer.quant.weights import PackedLayout, QuantizedWeight

__all__ = [
    "SUPPORTED", "PackedLayout", "QuantMethod", "QuantScheme", "QuantizedCheckpoint", "QuantizedWeight",
    "WeightScheme", "dequantize_tensors", "parse_quant_config", "read_quant_scheme",
]
