"""Multi-LoRA: adapter files and their checks, the manager of slots, the Triton kernels."""
