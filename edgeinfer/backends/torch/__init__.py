"""The PyTorch backend: eager engines, CUDA-graph decode and its fused Triton kernels."""
