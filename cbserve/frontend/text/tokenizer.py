"""Tokenizer loading and chat templates (the text back from token ids, streamed: ``detokenizer.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# tokenizer_config.json classes that are plain ``tokenizer.json`` tokenizers: loaded without AutoTokenizer,
# whose import pulls in torch (the ingress process never imports torch).
_PLAIN_FAST_CLASSES = frozenset({None, "PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(model: str | Path | None = None) -> Any:
    """The tokenizer (with its chat template) of ``model``: a folder (Path), or what ``model_folder`` takes
    (None = bundled default, an HF folder or a GGUF file, whose tokenizer comes from its converted folder)."""
    from cbserve.frontend.model_files import model_folder

    folder = model if isinstance(model, Path) else model_folder(model)
    if (folder / "tokenizer.json").exists() and _tokenizer_class(folder) in _PLAIN_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _tokenizer_class(folder: Path) -> str | None:
    path = folder / "tokenizer_config.json"
    try:
        return json.loads(path.read_text()).get("tokenizer_class") if path.exists() else None
    except (OSError, ValueError, AttributeError):
        return "unknown"  # let AutoTokenizer read it (and say what is wrong)


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Render chat ``messages`` with the model's template and return the prompt token ids."""
    if not getattr(tokenizer, "chat_template", None) and not template_kwargs.get("chat_template"):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"chat messages need 'role' and 'content', got {m!r}")
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
