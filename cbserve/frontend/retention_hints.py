"""A request's retention hints: the ranges of its prompt it asks the engine to keep cached
(``scheduler/kv/retention.py``), from ``retention_directives``, the chat messages' ``cache_control`` and
``prompt_cache_retention``. Resolved only for a request that carries any (serving.py); every problem is an
APIError naming the field (HTTP 400)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cbserve.frontend.protocol import APIError, ChatCompletionRequest, ChatMessage, SamplingFields
from cbserve.scheduler.requests.retention import Retention

DEFAULT_RETAIN_S = 300.0  # a retention directive without a duration: a prompt cache's usual five minutes
CACHE_CONTROL_TTL = {"5m": 300.0, "1h": 3600.0}  # Anthropic's ephemeral cache_control TTLs

# RequestValidator.render: (messages, add_generation_prompt, add_special_tokens, template kwargs) -> token ids
Render = Callable[[list[ChatMessage], bool, bool, dict[str, Any]], list[int]]


def retention_hints(priority: int, longest: float, req: SamplingFields, prompt_len: int,
                    marks: Sequence[tuple[int, float]] = ()) -> tuple[Retention, ...]:
    """The ranges of a prompt its request asks to keep cached: ``retention_directives``, the chat messages'
    ``cache_control`` (``marks``: where each marked message ends, and its TTL) and ``prompt_cache_retention``
    ("24h": the whole prompt, for 24 hours or the server's longest, whichever is shorter), at the server's
    ``priority`` and at most its ``longest`` seconds. The engine checks them against the prompt and the server's
    limits (a 400 naming what is wrong)."""
    out = [Retention(d.start, prompt_len if d.end is None else d.end, d.priority,
                     d.duration or min(DEFAULT_RETAIN_S, longest)) for d in req.retention_directives or ()]
    out += [Retention(0, end, priority, min(ttl, longest)) for end, ttl in marks]  # "up to" the TTL asked
    keep = req.prompt_cache_retention
    if keep == "24h":
        out.append(Retention(0, prompt_len, priority, min(86400.0, longest)))
    elif keep not in (None, "in_memory", "in-memory"):
        raise APIError(400, f"prompt_cache_retention must be 'in_memory' or '24h', got {keep!r}",
                       param="prompt_cache_retention")
    return tuple(out)


def cache_control_marks(render: Render, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                        prompt: list[int]) -> list[tuple[int, float]]:
    """The prefix ``cache_control`` marks (on a message or one of its content parts) ask to keep: the
    conversation up to the last marked message, rendered as the template renders it, for the longest TTL asked
    (a range keeps every block before its end: the earlier marks' prefixes come with it). One render; a template
    that cannot render that part of the conversation alone keeps nothing (the request runs all the same)."""
    marks = [(i, ttl) for i, m in enumerate(req.messages) if (ttl := cache_control_ttl(m)) is not None]
    if not marks:
        return []
    if req.truncate_prompt_tokens is not None:
        raise APIError(400, "cache_control does not combine with truncate_prompt_tokens", param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs |= {"chat_template": req.chat_template} if req.chat_template is not None else {}
    kwargs |= {"tools": tools} if tools is not None else {}
    try:
        upto = render(req.messages[: marks[-1][0] + 1], False, req.add_special_tokens, kwargs)
    except APIError:
        return []
    end = _common_prefix(upto, prompt)  # (a template that renders a conversation's start otherwise: what is shared)
    return [(end, max(ttl for _, ttl in marks))] if end else []


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def cache_control_ttl(m: ChatMessage) -> float | None:
    """The TTL a message's ``cache_control`` asks (on the message, or on one of its content parts), else None."""
    marks = [(m.model_extra or {}).get("cache_control")]
    if isinstance(m.content, list):
        marks += [p.get("cache_control") for p in m.content if isinstance(p, dict)]
    ttl = None
    for mark in marks:
        if mark is None:
            continue
        if not isinstance(mark, dict) or mark.get("type") != "ephemeral" or \
                mark.get("ttl", "5m") not in CACHE_CONTROL_TTL or set(mark) - {"type", "ttl"}:
            raise APIError(400, f"cache_control must be {{'type': 'ephemeral'}} with an optional ttl of "
                           f"{sorted(CACHE_CONTROL_TTL)}, got {mark!r}", param="messages")
        ttl = max(ttl or 0.0, CACHE_CONTROL_TTL[mark.get("ttl", "5m")])
    return ttl
