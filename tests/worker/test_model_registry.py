"""The model registry (worker/models/registry.py): the family modules it finds without torch, the model types
the start-up checks accept (model_info.SUPPORTED_MODEL_TYPES agrees with it), the class it builds for a
config, and the clear error an unsupported architecture gets at load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cbserve.worker.config import ModelConfig
from cbserve.worker.loading.model_info import SUPPORTED_MODEL_TYPES
from cbserve.worker.models import registry


def test_supported_types_come_from_the_family_modules() -> None:
    assert registry.supported_model_types() == SUPPORTED_MODEL_TYPES
    expected = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"}
    assert expected <= set(SUPPORTED_MODEL_TYPES)
    assert len(set(SUPPORTED_MODEL_TYPES)) == len(SUPPORTED_MODEL_TYPES)  # one family per model type
    for family in registry.families():
        cls = registry.model_class(SimpleNamespace(model_type=family.model_types[0]))
        assert cls.__name__ in family.architectures, family


def test_the_supported_types_are_read_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from cbserve.worker.loading import model_info\nprint(','.join(model_info.SUPPORTED_MODEL_TYPES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().split(",") == list(SUPPORTED_MODEL_TYPES)


def test_a_family_is_chosen_by_model_type_then_by_architecture() -> None:
    assert registry.family_for("qwen3").module == "qwen3"
    assert registry.family_for("my-mistral", ["MistralForCausalLM"]).module == "llama"
    with pytest.raises(NotImplementedError, match=r"model_type 'gpt2' .* not supported.*gemma2"):
        registry.family_for("gpt2", ["GPT2LMHeadModel"])
    with pytest.raises(NotImplementedError, match="not supported"):  # Gemma 3's multimodal checkpoint
        registry.family_for("gemma3", ["Gemma3ForConditionalGeneration"])


def test_a_new_family_file_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "decoder.py").write_text("X = 1\n")  # shared code: no MODEL_TYPES, not a family
    (tmp_path / "newarch.py").write_text('MODEL_TYPES = ("newarch", "newarch2")\nARCHITECTURES: tuple = '
                                         '("NewArchForCausalLM",)\nMODEL = object\n')
    monkeypatch.setattr(registry, "_FOLDER", tmp_path)
    registry.families.cache_clear()
    try:
        assert registry.families() == (registry.Family("newarch", ("newarch", "newarch2"), ("NewArchForCausalLM",)),)
        assert registry.family_for("newarch2").module == "newarch"
    finally:
        registry.families.cache_clear()


def test_an_unsupported_architecture_fails_at_load(tmp_path: Path) -> None:
    from cbserve.worker.runner.model_runner import ModelRunner

    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_head": 2, "n_embd": 8,
           "vocab_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expected = r"model_type 'gpt2' .* not supported; supported model types: .*llama"
    with pytest.raises(NotImplementedError, match=expected):
        ModelRunner(ModelConfig(model=str(tmp_path), device="cpu", block_size=4), progress=False)
