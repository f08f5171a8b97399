"""Reasoning ("thinking") text of a chat answer, split from the answer itself: what a reasoning model writes
between ``<think>`` and ``</think>`` goes to ``reasoning_content`` (and ``reasoning``, vLLM's newer name),
the rest to ``content``, whole (``split_reasoning``) or while a stream grows (``ReasoningStream``).

The parsers, by vLLM's names (``reasoning_parser`` in the config; "auto" picks one from the chat template
when its ``<think>`` handling is unambiguous):

- ``qwen3``: the model opens its reasoning itself; an output that does not start with ``<think>`` is all
  answer (Qwen3 with ``enable_thinking: false``, or a model that skipped thinking);
- ``deepseek_r1``: the chat template writes the opening ``<think>`` into the prompt, so the output starts
  inside the reasoning (an opening tag the model writes anyway is dropped); no ``</think>``: all reasoning.

Per request (``request_mode``) the prompt has the last word where it says something: a prompt that ends
with an open ``<think>`` starts the output inside the reasoning whatever the parser, one that ends with
``</think>`` (the template closed an empty reasoning) and ``chat_template_kwargs`` with ``enable_thinking``
(or ``thinking``) false make the output all answer.

Structured output and forced tool calls hold the answer only, as vLLM's do: a request that reasons sends its
grammar with a reasoning gate (``gated_spec``: the tags' token ids in the ``StructuredSpec``), so the worker
leaves the reasoning unmasked and starts the grammar at the token after ``</think>``
(``worker/sampling/structured.py``);
``max_tokens`` counts both. That needs each tag to be one token of the vocabulary (Qwen3's and DeepSeek-R1's
are); where it is not, the grammar holds from the first token and the output reasons only if the grammar
itself opens it with ``<think>``.

Tool calls and structured output are parsed from the answer only (``responses.ChatFormatter``). Nothing is
stripped: the reasoning, the tags and the content add up to the generated text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from cbserve.scheduler.requests.sampling_params import StructuredSpec

logger = logging.getLogger(__name__)

REASONING_PARSERS = ("qwen3", "deepseek_r1")
REASONING_PARSER_CHOICES = ("none", "auto", *REASONING_PARSERS)
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's answers split. ``inside``: the output starts inside the reasoning; else only an
    output that opens with ``start`` reasons."""

    inside: bool
    start: str = START
    end: str = END


def parser_for_template(template: str | None) -> str | None:
    """The reasoning parser a chat template calls for (None: it has no ``<think>`` handling, or it is
    ambiguous): ``deepseek_r1`` when its generation prompt opens ``<think>`` without closing it, ``qwen3``
    when it switches thinking with ``enable_thinking``."""
    if not template or START not in template:
        return None
    at = template.rfind("add_generation_prompt")
    generation = template[at:] if at != -1 else ""
    if START in generation and END not in generation:
        return "deepseek_r1"
    if "enable_thinking" in template:
        return "qwen3"
    return None


def resolve_reasoning_parser(setting: str | None, chat_template: str | None) -> str | None:
    """The ``reasoning_parser`` setting as a parser name (None or "none": off; "auto": from the chat
    template, logged)."""
    setting = "none" if setting is None else setting
    if setting not in REASONING_PARSER_CHOICES:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSER_CHOICES}, got {setting!r}")
    if setting != "auto":
        return None if setting == "none" else setting
    chosen = parser_for_template(chat_template if isinstance(chat_template, str) else None)
    if chosen is None:
        logger.info("reasoning_parser auto: the chat template has no unambiguous <think> handling; off")
    else:
        logger.info("reasoning_parser auto: %s, from the chat template", chosen)
    return chosen


def thinking_disabled(template_kwargs: dict[str, Any] | None) -> bool:
    """``chat_template_kwargs`` turn thinking off (Qwen3's ``enable_thinking``, DeepSeek's ``thinking``)."""
    kwargs = template_kwargs or {}
    return any(key in kwargs and not kwargs[key] for key in ("enable_thinking", "thinking"))


def request_mode(
    parser: str | None, prompt_tail: str, template_kwargs: dict[str, Any] | None = None, constrained: bool = False
) -> ReasoningMode | None:
    """How one chat request's answers split (None: all answer). ``prompt_tail``: the end of its prompt as
    text; ``constrained``: a grammar holds the output from its first token (no reasoning gate)."""
    if parser is None or thinking_disabled(template_kwargs):
        return None
    if constrained:
        return ReasoningMode(inside=False)
    tail = prompt_tail.rstrip()
    if tail.endswith(END):
        return None
    return ReasoningMode(inside=tail.endswith(START) or parser == "deepseek_r1")


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of the one token ``text`` is in the vocabulary (None: it takes several)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return int(ids[0]) if len(ids) == 1 else None


def gated_spec(spec: StructuredSpec, mode: ReasoningMode, tokenizer: Any) -> StructuredSpec | None:
    """``spec`` with the reasoning gate of a request whose answers split as ``mode``: the grammar waits for the
    end tag and, unless the output starts inside the reasoning, its first token may be the start tag instead.
    None when a tag it needs is not one token of the vocabulary."""
    end = single_token(tokenizer, mode.end)
    start = None if mode.inside else single_token(tokenizer, mode.start)
    if end is None or (start is None and not mode.inside):
        return None
    return replace(spec, reasoning_start=start, reasoning_end=end)


def _held_back(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """One choice's text as it grows: ``feed`` each new piece, get the (reasoning, content) pieces to send.
    Text that may still become a tag is held back until it is decided (or the text is final)."""

    mode: ReasoningMode
    phase: str = "start"  # "start" (undecided whether the output opens with the tag), "reasoning", "content"
    pending: str = ""
    reasoned: bool = False  # the output had a reasoning part (possibly empty)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        buf, self.pending = self.pending + text, ""
        if self.phase == "start":
            opened = buf.lstrip()
            if opened.startswith(self.mode.start):
                buf, self.phase = opened[len(self.mode.start) :], "reasoning"
            elif not final and self.mode.start.startswith(opened):  # "" or a piece of the tag: wait
                self.pending = buf
                return "", ""
            else:
                self.phase = "reasoning" if self.mode.inside else "content"
            self.reasoned = self.phase == "reasoning"
        if self.phase == "content":
            return "", buf
        end = buf.find(self.mode.end)
        if end == -1:
            keep = len(buf) - (0 if final else _held_back(buf, self.mode.end))
            self.pending = buf[keep:]
            return buf[:keep], ""
        self.phase = "content"
        return buf[:end], buf[end + len(self.mode.end) :]


def split_reasoning(mode: ReasoningMode, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished answer: None for an empty reasoning; the content None when the
    answer had a reasoning part and nothing after it."""
    stream = ReasoningStream(mode)
    reasoning, content = stream.feed(text, final=True)
    if not stream.reasoned:
        return None, content
    return reasoning or None, content or None
