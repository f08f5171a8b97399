"""A trainer's LoRA adapter pushed as tensors (``rl/adapters.py``) and checked by the front end as a folder's adapter
is (``LoRARegistry.check_content``): PEFT's ``LoraConfig`` (sets, enums) becomes the JSON its ``save_pretrained``
writes, the bytes round-trip to the same tensors, a push under a served name needs ``replace`` and gets a new id,
and an adapter that does not fit the model, or a server without LoRA, is a 400 with the reason. The served path (a
Serve handle, every replica, HF + PEFT's tokens) is ``tests/e2e/test_rl_loop.py``'s."""

from __future__ import annotations

import json

import pytest
import torch
from test_lora_serving import INFO

from cbserve.frontend.lora_registry import NOT_ENABLED, PUSHED, AdapterLimits, LoRARegistry
from cbserve.frontend.protocol import APIError
from cbserve.rl.adapters import adapter_content, config_dict
from cbserve.worker.lora.files import parse_adapter


def _tensors(rank: int = 4, layers: int = 2, hidden: int = 64) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {}
    for layer in range(layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn"
        out[f"{prefix}.q_proj.lora_A.weight"] = torch.randn(rank, hidden)
        out[f"{prefix}.q_proj.lora_B.weight"] = torch.randn(64, rank)
    return out


def _config(rank: int = 4) -> object:
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj"])


def test_peft_config_and_tensors_become_the_files_bytes() -> None:
    config = _config()
    as_dict = config_dict(config)
    assert as_dict["target_modules"] == ["q_proj"] and as_dict["peft_type"] == "LORA" and as_dict["r"] == 4
    tensors = _tensors()
    content = adapter_content(tensors, config)
    assert json.loads(content.config) == as_dict
    files = parse_adapter(content)
    assert files.rank == 4 and {m.projection for m in files.modules} == {"q_proj"} and len(files.modules) == 2
    from safetensors.torch import load

    back = load(content.weights)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(TypeError, match="LoraConfig"):
        config_dict(["not", "a", "config"])


def test_a_push_is_checked_and_replaces_only_when_asked() -> None:
    registry = LoRARegistry("base", AdapterLimits(INFO, max_lora_rank=8))
    first = adapter_content(_tensors(), _config())
    checked = registry.check_content("policy", first)
    assert checked.folder == f"{PUSHED}policy" and checked.content is first
    lora = registry.register("policy", checked.folder, content=checked.content)
    with pytest.raises(APIError, match="already been loaded") as taken:
        registry.check_content("policy", first)
    assert taken.value.status == 400
    second = adapter_content({k: 2 * v for k, v in _tensors().items()}, _config())
    again = registry.register("policy", registry.check_content("policy", second, replace=True).folder, True, second)
    assert again.lora_int_id > lora.lora_int_id and again.digest == second.digest != first.digest
    assert [a.lora_name for a in registry.adapters()] == ["policy"]


def test_a_push_that_does_not_fit_is_a_400_with_the_reason() -> None:
    registry = LoRARegistry("base", AdapterLimits(INFO, max_lora_rank=8))
    for content, why in ((adapter_content(_tensors(rank=16), _config(16)), "rank 16 is over max_lora_rank 8"),
                         (adapter_content(_tensors(hidden=32), _config()), "q_proj"),
                         (adapter_content({"model.embed.weight": torch.ones(2, 2)}, _config()), "not a LoRA weight")):
        with pytest.raises(APIError, match=why) as refused:
            registry.check_content("policy", content)
        assert refused.value.status == 400 and registry.adapters() == []
    with pytest.raises(APIError, match="LoRA is not enabled") as off:
        LoRARegistry("base").check_content("policy", adapter_content(_tensors(), _config()))
    assert off.value.message == NOT_ENABLED
