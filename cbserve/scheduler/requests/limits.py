"""Length limits of one request, decided once for the engine and the HTTP edge.

``resolve_max_tokens`` is the one place that checks a prompt against ``max_model_len`` and fills in an
unset ``max_tokens`` (all the room left in the context). The ingress calls it to answer 400 before a
request reaches an engine; ``EngineCore`` calls it again on admission (requests also come from ``LLM``
and tests). Its errors carry ``param``: the request field to blame.
"""

from __future__ import annotations

from cbserve.scheduler.errors import RequestRejectedError
from cbserve.scheduler.requests.sampling_params import SamplingParams


def context_length_message(max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> str:
    """OpenAI's wording for a request longer than the model's context."""
    asked = num_prompt_tokens + max_tokens
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {asked} "
        f"tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the completion)."
    )


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The number of tokens the request may generate: ``max_tokens``, or all the room left in the
    context when it is None. Raises RequestRejectedError for an empty prompt, a prompt that leaves no
    room, or prompt + max_tokens over ``max_model_len``."""
    if num_prompt_tokens <= 0:
        raise RequestRejectedError("the prompt is empty: at least one prompt token is needed", param="prompt")
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise RequestRejectedError(
                f"{context_length_message(max_model_len, num_prompt_tokens, 0)} The prompt has "
                f"{num_prompt_tokens} tokens but max_model_len is {max_model_len}: no room to generate",
                param="prompt",
            )
        return max_model_len - num_prompt_tokens
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestRejectedError(
            f"{context_length_message(max_model_len, num_prompt_tokens, max_tokens)} prompt "
            f"({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds max_model_len "
            f"({max_model_len})",
            param="max_tokens" if num_prompt_tokens < max_model_len else "prompt",
        )
    return max_tokens


def check_pooling_prompt(num_prompt_tokens: int, max_model_len: int, params: SamplingParams | None = None) -> int:
    """A prompt to embed (a pooling engine generates nothing) fits when it holds 1 to ``max_model_len``
    tokens; its one "output token" is never computed. Returns the max_tokens the engine gives it (1).
    Raises RequestRejectedError naming ``input``."""
    if params is not None and (params.num_sequences != 1 or params.use_beam_search):
        raise RequestRejectedError("a pooling model embeds its input once: n, best_of and beam search are not "
                                   "available", param="n")
    if num_prompt_tokens <= 0:
        raise RequestRejectedError("the input is empty: at least one token is needed", param="input")
    if num_prompt_tokens > max_model_len:
        raise RequestRejectedError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens} tokens in the input for embedding generation. Please reduce the length of the "
            "input (or set truncate_prompt_tokens).",
            param="input",
        )
    return 1
