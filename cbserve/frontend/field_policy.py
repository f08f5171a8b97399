"""Nothing silently ignored: every declared request field that cbserve does not implement is refused with a
400 naming it when a request sets it to anything but a harmless value; fields nobody declared are logged
once per name (per ``FieldPolicy``, i.e. per server) and otherwise ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from cbserve.frontend.protocol import APIError, ChatCompletionRequest

logger = logging.getLogger(__name__)

USE_STRUCTURED = "(deprecated) is not supported; use structured_outputs"
Harmless = Callable[[Any], bool]


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {}


# field -> (why it is refused, which values are accepted anyway)
REFUSED: dict[str, tuple[str, Harmless]] = {
    "suffix": ("insertion (fill-in-the-middle) is not supported", _falsy),
    "spaces_between_special_tokens": ("only true is supported", lambda v: v is True),
    "return_tokens_as_token_ids": ("is not supported", _falsy),
    "logits_processors": ("(custom logits processors) is not supported", _falsy),
    "vllm_xargs": ("is not supported", _falsy),
    "prompt_embeds": ("is not supported", _falsy),
    "store": ("(stored completions) is not supported", _falsy),
    "metadata": ("(for stored completions) is not supported", _falsy),
    "service_tier": ("only 'auto' and 'default' are supported", lambda v: v in (None, "auto", "default")),
    "prompt_cache_key": ("is not supported (the router keeps a prompt prefix on one replica itself)", _falsy),
    "documents": ("is not supported", _falsy),
    "mm_processor_kwargs": ("is not supported (text-only models)", _falsy),
    "audio": ("is not supported (text-only models)", _falsy),
    "modalities": ("only ['text'] is supported", lambda v: v in (None, ["text"])),
    "prediction": ("(predicted outputs) is not supported", _falsy),
    "reasoning_effort": ("is not supported: cbserve cannot budget a model's reasoning (with a reasoning parser, "
                         "chat_template_kwargs {\"enable_thinking\": false} turns Qwen3's thinking off)", _falsy),
    "verbosity": ("is not supported", _falsy),
    "web_search_options": ("is not supported", lambda v: v is None),  # {} turns web search on
    "functions": ("(deprecated) is not supported; use tools", _falsy),
    "function_call": ("(deprecated) is not supported; use tool_choice", _falsy),
    # vLLM's older guided decoding fields (structured output is response_format / structured_outputs)
    "guided_json": (USE_STRUCTURED, _falsy),
    "guided_regex": (USE_STRUCTURED, _falsy),
    "guided_choice": (USE_STRUCTURED, _falsy),
    "guided_grammar": (USE_STRUCTURED, _falsy),
    "guided_decoding_backend": ("only xgrammar is supported", lambda v: v in (None, "auto", "xgrammar")),
    "guided_whitespace_pattern": ("is not supported", _falsy),
}


# chat only (vLLM's chat ``echo`` repeats the last message; /v1/completions honours its own ``echo``)
CHAT_REFUSED: dict[str, tuple[str, Harmless]] = {"echo": ("is only supported on /v1/completions", _falsy),
                                                  "return_token_ids": ("is only supported on /v1/completions", _falsy)}


class FieldPolicy:
    def __init__(self) -> None:
        self._logged: set[str] = set()

    def check(self, req: BaseModel) -> None:
        """APIError 400 for the first refused field the request sets; log unknown extra fields once."""
        chat = isinstance(req, ChatCompletionRequest)
        for name in req.model_fields_set:
            rule = REFUSED.get(name) or (CHAT_REFUSED.get(name) if chat else None)
            if rule is not None and not rule[1](getattr(req, name)):
                raise APIError(400, f"{name} {rule[0]}", param=name)
        opts = getattr(req, "stream_options", None)
        if opts is not None and opts.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported",
                           param="stream_options.continuous_usage_stats")
        for name in sorted(req.model_extra or {}):
            if name not in self._logged:
                self._logged.add(name)
                logger.warning("ignoring unknown request field %r (%s); logged once", name, type(req).__name__)
