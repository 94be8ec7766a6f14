"""The ONNX Runtime backend: the export of both engines to ONNX and their sessions."""
