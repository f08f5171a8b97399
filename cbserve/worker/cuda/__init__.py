"""What runs on CUDA only: decode and piecewise CUDA graphs, the fused Triton kernels."""
