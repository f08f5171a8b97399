"""Build a causal LM on a worker from its folder: the target model of ``ModelRunner`` and the draft model of
speculative decoding (``draft_model.py``) alike."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbserve.worker.attention.selector import get_attention_backend
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu.gguf_blocks import load_gguf_blocks
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.ops import PackAsLoaded, resolve_cpu_ops
from cbserve.worker.cpu.probe import model_weights
from cbserve.worker.fp8 import check_fp8_device
from cbserve.worker.layers.fp8_linear import quantize_linear_weights
from cbserve.worker.loading.model_loader import iter_weights
from cbserve.worker.models.registry import model_class

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass(frozen=True)
class BuiltModel:
    model: Any
    cpu_ops: str  # the resolved cpu_ops mode
    backend_cls: type
    dtype: torch.dtype  # the model's and its KV cache's: float32 for bfloat16 products on the CPU kernels
    kernels: CpuKernels | None  # the CPU C kernels the model runs on (native ops), else None
    cpu_report: dict[str, Any]  # CpuOps.report(): mode, ISA level, probe figures (/stats)


def build_model(
    folder: Path,
    hf_config: Any,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    progress: bool,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> BuiltModel:
    """The model of ``folder`` with its weights loaded, in eval mode; its linear weights in FP8 with
    ``quantization="fp8"`` (layers/fp8_linear.py), else on CPU packed for the kernels (the GGUF blocks kept when
    ``cpu_compact_weights``). ``weights``: HF-named tensors to load instead of the folder's (benchmarks with random
    weights); the folder still gives the config."""
    weight_format, weight_values = model_weights(folder)
    # the weights kept compact: the folder's, unless other weights are given (no GGUF blocks of theirs to keep)
    compact_format = weight_format if config.cpu_compact_weights and weights is None else "f32"
    ops = resolve_cpu_ops(fp8_cpu_ops(config, device), device, dtype, config.cpu_isa, probe_shape(hf_config),
                          compact_format, weight_values,
                          (config.cpu_decode_activations, config.cpu_prefill_activations))
    if ops.bf16_products:  # bfloat16 on the C kernels: a float32 model and KV cache, bfloat16 products
        dtype = torch.float32
        logger.info("dtype bfloat16 on the CPU kernels: linear layers multiply in bfloat16, the rest is float32")
    backend_cls = get_attention_backend(config.attention_backend, device, ops.native, config.cpu_isa, config.kv_fp8)
    model_cls = model_class(hf_config)  # NotImplementedError naming what is supported
    with default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, backend_cls, max_model_len, ops)
    place_weights(model, weights if weights is not None else iter_weights(folder, progress=progress), folder, config,
                  device)
    model.eval()
    return BuiltModel(model, ops.mode, backend_cls, dtype, ops.kernels, ops.report())


def place_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]], folder: Path, config: ModelConfig,
                  device: torch.device) -> None:
    """Load HF-named ``weights`` into ``model``, then quantize them to FP8 (``quantization="fp8"``) or, on CPU, pack
    them for the model's ops (with the folder's GGUF blocks when ``cpu_compact_weights``): a build, and a wake after
    the weights slept (sleep_mode.py)."""
    cpu = device.type == "cpu"
    compact = cpu and config.cpu_compact_weights and model.ops.native
    fused = model.fused_quant_blocks(load_gguf_blocks(folder)) if compact else None
    # on CPU each linear weight is packed as soon as it is loaded, unless FP8 quantizes them all first
    as_loaded = cpu and config.quantization is None
    model.load_weights(weights, PackAsLoaded(model, model.ops, fused, compact) if as_loaded else None)
    if config.quantization == "fp8":  # before the CPU packing below, which keeps what is already packed
        quantize_linear_weights(model)
    if cpu:
        model.finish_loading(fused, compact)


def fp8_cpu_ops(config: ModelConfig, device: torch.device) -> str:
    """The cpu_ops to build with: ``config.cpu_ops``, but "torch" for FP8 weights on CPU (an emulation on the torch
    ops: "auto" resolves to it, "native" / "onednn" are refused). ValueError where ``device`` cannot run the FP8
    settings (a GPU below compute capability 8.9)."""
    for what, on in ((f"quantization={config.quantization!r}", config.quantization is not None),
                     (f"kv_cache_dtype={config.kv_cache_dtype!r}", config.kv_fp8)):
        if on:
            check_fp8_device(device, what)
    if device.type != "cpu" or config.quantization is None:
        return config.cpu_ops
    if config.cpu_ops in ("native", "onednn"):
        raise ValueError(f"quantization={config.quantization!r} on CPU is an emulation on the torch ops; cpu_ops="
                         f"{config.cpu_ops!r} does not run it (use cpu_ops 'auto' or 'torch')")
    return "torch"


def probe_shape(hf_config: Any) -> tuple[int, int]:
    """The model's hidden size and MLP width (a mixture of experts': one expert's), for the cpu_ops probe."""
    hidden = int(hf_config.hidden_size)
    inter = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "moe_intermediate_size", None)
    return hidden, int(inter or 4 * hidden)
