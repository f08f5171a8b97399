"""Pick an attention backend by name. "triton" and "flash" are imported lazily, only when asked for; "cpu"
compiles cbserve's C kernels on first use (../cpu/native.py)."""

from __future__ import annotations

import importlib
import logging

import torch

from cbserve.worker.attention.backend import AttentionBackend
from cbserve.worker.attention.cpu_backend import CpuAttentionBackend
from cbserve.worker.attention.torch_backend import TorchAttentionBackend
from cbserve.worker.cpu.native import load_cpu_kernels

logger = logging.getLogger(__name__)

# name -> (module, class); modules other than torch's may be missing or unusable on this machine.
_LAZY_BACKENDS: dict[str, tuple[str, str]] = {
    "triton": ("cbserve.worker.attention.triton_backend", "TritonAttentionBackend"),
    "flash": ("cbserve.worker.attention.flash_backend", "FlashAttentionBackend"),
}


def _load(name: str) -> type[AttentionBackend]:
    module_name, class_name = _LAZY_BACKENDS[name]
    module = importlib.import_module(module_name)
    return getattr(module, class_name)


def get_attention_backend(
    name: str, device: torch.device | str, native_cpu: bool = True, cpu_isa: str = "auto", kv_fp8: bool = False
) -> type[AttentionBackend]:
    """The backend class for ``name`` ("auto" | "torch" | "cpu" | "triton" | "flash") on ``device``.

    "auto" picks cpu on CPU when ``native_cpu`` (the model runs on cbserve's C kernels, see cpu/ops.py) and
    the kernels build, else torch; on CUDA it tries triton, then flash,
    and falls back to torch. Asking for "cpu"/"triton"/"flash" explicitly raises ValueError when it cannot
    be used. ``cpu_isa``: the build of the C kernels the "cpu" backend needs (cpu/native.py). ``kv_fp8``: an FP8
    KV cache (kv_fp8.py), which only triton and torch read: "auto" picks triton on CUDA, torch on CPU.
    """
    device = torch.device(device)
    if kv_fp8:
        return _fp8_backend(name, device)
    if name == "torch":
        return TorchAttentionBackend
    if name == "auto" and device.type == "cpu" and not native_cpu:
        return TorchAttentionBackend
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _cpu_backend(device, name == "cpu", cpu_isa)
    if name in _LAZY_BACKENDS:
        if device.type != "cuda":
            raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
        try:
            return _load(name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"attention backend {name!r} is not available: {e}") from e
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}")
    if device.type == "cuda":
        for candidate in ("triton", "flash"):
            try:
                return _load(candidate)
            except Exception as e:  # a missing or broken optional backend must never break "auto"
                logger.info("attention backend %s unavailable (%s)", candidate, e)
    return TorchAttentionBackend


def _cpu_backend(device: torch.device, explicit: bool, isa: str) -> type[AttentionBackend]:
    if device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' needs a CPU device, got {device}")
    load = load_cpu_kernels(isa)
    if load.kernels is not None:
        return CpuAttentionBackend
    if explicit:
        raise ValueError(f"attention backend 'cpu' is not available: {load.reason}")
    logger.warning("CPU attention kernels unavailable (%s); using the torch attention backend", load.reason)
    return TorchAttentionBackend


def _fp8_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    if name in ("cpu", "flash"):
        raise ValueError(f"attention backend {name!r} does not read an FP8 KV cache (kv_cache_dtype fp8): use "
                         "'triton' or 'torch'")
    if name == "torch" or (name == "auto" and device.type == "cpu"):
        return TorchAttentionBackend
    if name not in ("auto", "triton"):
        raise ValueError(f"unknown attention backend {name!r}")
    if device.type != "cuda":
        raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device}")
    try:
        return _load("triton")
    except (ImportError, AttributeError) as e:
        if name == "triton":
            raise ValueError(f"attention backend 'triton' is not available: {e}") from e
        logger.warning("attention backend triton unavailable (%s): the FP8 KV cache is read by the torch backend", e)
        return TorchAttentionBackend
