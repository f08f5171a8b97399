"""Loading packs each linear weight as soon as all its parts are in (``cpu.ops.PackAsLoaded``): the float32 weights
of one layer are in memory at once, not the whole model's. What the packed model computes is checked by every
model test (they all load through ``place_weights``); here, when each weight is packed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from family_testlib import make_family_model

from cbserve.worker.attention.selector import get_attention_backend
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.linear import Packable
from cbserve.worker.cpu.ops import resolve_cpu_ops
from cbserve.worker.loading.model_build import place_weights
from cbserve.worker.loading.model_loader import iter_weights, load_hf_config
from cbserve.worker.models.registry import model_class

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")
CPU = torch.device("cpu")


def _model(folder: Path, cpu_ops: str) -> torch.nn.Module:
    hf_config = load_hf_config(folder)
    ops = resolve_cpu_ops(cpu_ops, CPU, torch.float32)
    backend = get_attention_backend("cpu" if ops.native else "torch", CPU, ops.native, "auto", False)
    return model_class(hf_config)(hf_config, backend, 64, ops)


@pytest.mark.parametrize("cpu_ops", ["native", "onednn"])
def test_each_linear_weight_is_packed_once_its_parts_are_loaded(tmp_path: Path, cpu_ops: str) -> None:
    if cpu_ops == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    folder = make_family_model(tmp_path, "mistral")  # q/k/v and gate/up fused at load, an untied LM head
    config = ModelConfig(model=str(folder), cpu_ops=cpu_ops, device="cpu")  # type: ignore[arg-type]
    model = _model(folder, cpu_ops)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Packable)}  # the LM head too
    sizes = {name: m.weight.numel() for name, m in linears.items()}
    seen: list[str] = []
    held: list[int] = []  # after each checkpoint tensor: values of the linear weights begun and not yet packed

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_weights(folder, progress=False):
            yield name, tensor
            seen.append(name)  # load_weights has taken it (and packed what it completed) before asking for more
            held.append(sum(sizes[n] for n, m in linears.items() if m.packed is None and _parts(n) & set(seen)))
            _check(linears, seen)

    place_weights(model, weights(), folder, config, CPU)
    assert all(m.packed is not None and m.weight.numel() == 0 for m in linears.values())
    layer = sum(size for n, size in sizes.items() if n.startswith("model.layers.0."))
    assert len(held) == len(seen) > 0 and 0 < max(held) <= max(layer, sizes["lm_head"]), (held, layer)


def _parts(module_name: str) -> set[str]:
    """The checkpoint tensors a linear layer of the model is loaded from (a fused one's parts)."""
    prefix, _, leaf = module_name.rpartition(".")
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    return {f"{prefix}.{part}.weight".lstrip(".") for part in fused.get(leaf, [leaf])}


def _check(linears: dict[str, Any], seen: list[str]) -> None:
    """Every linear layer whose parts are all in is packed, its float32 copy released; the others are not packed."""
    for name, module in linears.items():
        done = _parts(name) <= set(seen)
        assert (module.packed is not None) is done, (name, seen[-1])
        assert (module.weight.numel() == 0) is done, (name, seen[-1])
