"""The TensorRT backend: engines built from the ONNX graphs per device profile, and their runtime."""
