"""Incremental (streaming) detokenization with stop strings: one sequence's output tokens turned into text, step
by step (``IncrementalDetokenizer``, one per sequence: frontend/output.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Prompt tokens kept as left context so the first output token decodes with its leading space.
_PROMPT_CONTEXT_TOKENS = 5


def ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` of a list of ids, as one function. For a fast tokenizer whose ``decode`` only calls
    its Rust tokenizer (transformers' own ``decode``, no clean-up of tokenization spaces) that call is made
    directly: the same text without the wrapper's argument checks, two of which run for every streamed token."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    direct = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    if direct:
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass
class DetokenizerUpdate:
    new_text: str  # text to emit now (may be "" while a partial character or stop string is pending)
    stopped: bool = False  # a stop string was found; the output ends here
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, step by step.

    Decodes a sliding window of tokens so that multi-byte characters split across tokens are emitted
    only once complete, and watches for stop strings: text is held back while it could still be the
    start of a stop string; when one appears the output is cut there (kept, with
    ``include_stop_str_in_output``), and ``stopped`` is reported. Until more than ``min_tokens`` tokens
    were generated no stop string counts (as in vLLM): that text is emitted and never searched again.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.min_tokens = min_tokens
        self._decode = ids_decoder(tokenizer, skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_context = len(self._ids)
        self._text = ""  # decoded output text (complete characters)
        self._emitted = 0  # chars of _text already returned
        self._searched = 0  # text before this is never searched for stop strings (min_tokens)
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the output

    @property
    def text(self) -> str:
        """All output text so far (cut at the stop string once stopped)."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Feed newly generated token ids; returns the text that can be emitted now."""
        if self.stopped:
            return DetokenizerUpdate("", True)
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._check_stop(final=False)

    def flush(self) -> str:
        """At the end of the sequence: emit whatever is still held back (incomplete characters included)."""
        if not self.stopped:
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix):
                self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
            update = self._check_stop(final=True)
            return update.new_text
        return ""

    def _check_stop(self, final: bool) -> DetokenizerUpdate:
        if self.stop and len(self.output_token_ids) <= self.min_tokens:
            new, self._emitted = self._text[self._emitted :], len(self._text)
            self._searched = len(self._text)
            return DetokenizerUpdate(new)
        if self.stop:
            # A new match can only start within the longest stop string's reach of the emitted text.
            longest = max(len(s) for s in self.stop)
            search_from = max(self._searched, self._emitted - longest + 1)
            hit = _find_first(self._text, self.stop, search_from)
            if hit is not None:
                pos, s = hit
                self._text = self._text[: pos + len(s)] if self.include_stop else self._text[:pos]
                self.stopped, self.stop_reason = True, s
                new = self._text[self._emitted :]
                self._emitted = len(self._text)
                return DetokenizerUpdate(new, True, s)
        end = len(self._text) if final else len(self._text) - self._pending_stop_prefix()
        new = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return DetokenizerUpdate(new)

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best


def _find_first(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
