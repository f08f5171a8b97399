"""FP8 (OCP e4m3, ``torch.float8_e4m3fn``) numerics shared by the quantized linear layers (``layers/fp8_linear.py``)
and the FP8 KV cache (``attention/kv_fp8.py``), and the check that a device can run them.

One rule everywhere: a row (a weight's output channel, a token's activations, one key or value head vector) is
stored as ``q = clamp(x / s, -448, 448)`` rounded to e4m3 with ``s = max(amax(|x|) / 448, MIN_SCALE)`` in float32,
and read back as ``q * s``. The Triton kernels (``attention/triton_jit.py``, ``cuda/fp8_quant.py``) compute the same
formula; these torch functions are their reference.

On CUDA the FP8 paths need compute capability 8.9 or newer (Ada, Hopper): FP8 tensor-core matmuls
(``torch._scaled_mm``) and Triton's e4m3 conversions. On CPU they run as an emulation for accuracy checks: the same
stored bytes and scales, dequantized and multiplied in float32.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # the smallest scale (vLLM's floor): an all-zero row stays finite
MIN_CAPABILITY = (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., n] as (e4m3 values of x's shape, float32 scales [..., 1]): one scale per row of the last
    dimension, the row's largest magnitude mapped to 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` (scale [..., 1], or broadcastable to q) in ``dtype``, computed in float32."""
    return (q.float() * scale).to(dtype)


def fp8_device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run cbserve's FP8 kernels (None: it can, or it is a CPU, which emulates them)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 runs on CUDA devices (or emulated on CPU), not on {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"FP8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, "
            f"Hopper, Blackwell); {device} is {name}, compute capability {cap[0]}.{cap[1]}"
        )
    return None


def check_fp8_device(device: torch.device, what: str) -> None:
    """ValueError naming ``what`` (the setting) when ``device`` cannot run FP8; on CPU a log line that it is
    emulated."""
    problem = fp8_device_problem(device)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    if device.type == "cpu":
        logger.warning(
            "%s on CPU is an emulation for accuracy checks (FP8 values and scales stored as on a GPU, "
            "dequantized and multiplied in float32): slower than the unquantized model",
            what,
        )
