"""Which GGUF files cbserve loads, read from their header's metadata without torch.

A GGUF file is converted through transformers' GGUF loader (``model_loader.convert_gguf``), so cbserve serves
the llama.cpp architectures that loader maps to a family of ``models/``, and refuses, with the reason, those
it cannot load right (including files it would load wrong without an error). Where the loader drops a value
the metadata states and the model needs, ``gguf_config_fixes`` gives it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# llama.cpp architecture -> the config.json model_type transformers' GGUF loader builds (a family serves each).
# Mistral files are llama.cpp "llama" files and load as Llama.
GGUF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",  # the file holds the text backbone only
    "phi3": "phi3",
}
# architectures of families cbserve serves from safetensors but not from GGUF: why not
_REFUSED = {
    "gemma": "transformers' GGUF loader does not map llama.cpp architecture 'gemma' (Gemma 1); serve the HF "
             "safetensors folder instead",
}
# GGUF "{arch}.<key>" -> HF config key, per architecture: values transformers' GGUF loader drops
_DROPPED = {
    "qwen3": {"attention.key_length": "head_dim"},  # transformers keeps Qwen3Config's default (128)
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},  # it keeps the default (768)
}


def gguf_model_type(meta: Mapping[str, Any], source: object) -> str:
    """The model_type cbserve serves the GGUF file ``source`` (described by its header ``meta``) as;
    ValueError saying why when it is not served."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{source}: the GGUF header names no general.architecture")
    if arch == "llama" and meta.get("llama.expert_count"):
        raise ValueError(
            f"{source}: a llama-architecture GGUF with experts (Mixtral) is not supported: transformers' GGUF "
            "loader reads it as a dense Llama and leaves the MLP weights random; serve the HF safetensors folder"
        )
    if arch == "llama" and meta.get("general.name") == "mistral":
        raise ValueError(
            f"{source}: transformers' GGUF loader cannot load a llama-architecture GGUF whose general.name is "
            "'mistral' (it asks gguf-py for an architecture 'mistral', which does not exist)"
        )
    if arch in _REFUSED:
        raise ValueError(f"{source}: {_REFUSED[arch]}")
    if arch not in GGUF_MODEL_TYPES:
        raise ValueError(
            f"{source}: GGUF architecture {arch!r} is not supported (supported GGUF architectures: "
            f"{', '.join(GGUF_MODEL_TYPES)})"
        )
    return GGUF_MODEL_TYPES[arch]


def gguf_config_fixes(meta: Mapping[str, Any]) -> dict[str, Any]:
    """HF config values the header states that transformers' GGUF loader drops (set them on its config)."""
    arch = str(meta.get("general.architecture"))
    return {hf: meta[f"{arch}.{key}"] for key, hf in _DROPPED.get(arch, {}).items() if f"{arch}.{key}" in meta}
