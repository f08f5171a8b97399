"""Tool calls in a model's output text: the formats cbserve parses, whole (a finished answer) and partial
(a stream, while the text grows).

- ``hermes``: Hermes / Qwen style, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
  with free content before them;
- ``llama3_json``: Llama 3.x style, the whole output is ``{"name": ..., "parameters": {...}}`` objects
  (optionally after ``<|python_tag|>``, several separated by ``;``), or else plain content;
- ``required``: what ``tool_choice="required"`` forces by a JSON schema, ``[{"name": ..., "parameters":
  {...}}, ...]``;
- ``named``: what a named ``tool_choice`` forces, the function's arguments object alone.

A call's ``arguments`` is the raw JSON text of the model's output (not re-serialised), so the pieces a
stream sends add up to exactly the final arguments. While an object is incomplete its arguments text holds
back a trailing run of ``}`` and whitespace, which may close the call rather than the arguments.

A forced call (``required``, ``named``) is a call whatever ends the output, as vLLM returns it: in a final
text cut short (``max_tokens``, a stop string) inside its first call, that call counts as complete, its
arguments the partial JSON as generated (a later call cut short is dropped: the complete ones are the answer,
and a client that sends the answer back in its history would send arguments that are not JSON).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = " \t\r\n"
_DECODER = json.JSONDecoder()


@dataclass
class ParsedCall:
    name: str | None  # None until the name is complete
    arguments: str  # raw JSON text of the arguments so far (all of it once complete)
    complete: bool


@dataclass
class ParsedOutput:
    content: str  # text that is not a tool call (so far)
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete and c.name is not None]


def _skip(text: str, pos: int, chars: str = _WS) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _decode(text: str, pos: int) -> tuple[object, int] | None:
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def scan_call(text: str, pos: int, cut: bool = False) -> tuple[ParsedCall, int | None]:
    """The call object at ``text[pos]`` (a ``{``) and the index after it (None while incomplete).
    ``cut``: the text ends here for good (an incomplete call's arguments are all the rest)."""
    head = _HEAD.match(text, pos)
    whole = _decode(text, pos)
    if whole is not None:
        obj, end = whole
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedCall(None, "", True), end
        args = _decode(text, head.end()) if head else None
        if args is not None:
            raw = text[head.end() : args[1]]  # type: ignore[union-attr]
        else:
            raw = json.dumps(obj.get("arguments", obj.get("parameters", {})), ensure_ascii=False)
        return ParsedCall(obj["name"], raw, True), end
    if head is None:
        return ParsedCall(None, "", False), None
    name = json.loads(f'"{head.group(1)}"')
    args = _decode(text, head.end())
    rest = text[head.end() :]
    raw = text[head.end() : args[1]] if args is not None else (rest if cut else rest.rstrip(_WS + "}"))
    return ParsedCall(name, raw, False), None


def scan_calls(text: str, pos: int, separators: str, cut: bool = False) -> tuple[list[ParsedCall], int]:
    """Call objects from ``pos`` on, separated by whitespace and ``separators``; stops at anything else or at
    an incomplete object. Returns the calls and where scanning stopped (``cut``: as in ``scan_call``)."""
    calls: list[ParsedCall] = []
    while True:
        pos = _skip(text, pos, _WS + separators)
        if pos >= len(text) or text[pos] != "{":
            return calls, pos
        call, end = scan_call(text, pos, cut)
        calls.append(call)
        if end is None:
            return calls, len(text)
        pos = end


def _held_back_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_hermes(text: str, final: bool) -> ParsedOutput:
    start = text.find(_HERMES_OPEN)
    if start == -1:
        keep = len(text) if final else len(text) - _held_back_prefix(text, _HERMES_OPEN)
        return ParsedOutput(text[:keep])
    out = ParsedOutput(text[:start])
    while start != -1:
        pos = _skip(text, start + len(_HERMES_OPEN))
        if pos < len(text) and text[pos] == "{":
            call, end = scan_call(text, pos)
            out.calls.append(call)
            if end is None:
                break
            pos = end
        close = text.find(_HERMES_CLOSE, pos)
        if close == -1:
            break
        start = text.find(_HERMES_OPEN, close)
        after = text[close + len(_HERMES_CLOSE) : start if start != -1 else len(text)]
        if final and after.strip():  # content between or after the calls
            out.content += after
    return out


def parse_llama3_json(text: str, final: bool) -> ParsedOutput:
    pos = _skip(text, 0)
    if not final and _PYTHON_TAG.startswith(text[pos:]):
        return ParsedOutput("")  # undecided until the first character that is not whitespace
    if text.startswith(_PYTHON_TAG, pos):
        pos = _skip(text, pos + len(_PYTHON_TAG))
    if pos >= len(text):
        return ParsedOutput("")
    if text[pos] != "{":
        return ParsedOutput(text)
    calls, _ = scan_calls(text, pos, ";")
    return ParsedOutput("", calls)


def parse_required(text: str, final: bool) -> ParsedOutput:
    pos = _skip(text, 0)
    if pos >= len(text) or text[pos] != "[":
        return ParsedOutput(text if final else "")
    calls, _ = scan_calls(text, pos + 1, ",", cut=final)
    if final and len(calls) == 1 and not calls[0].complete and calls[0].name is not None:
        calls[0].complete = True  # cut short in the first call: the forced call as far as it got
    return ParsedOutput("", calls)


def parse_named(name: str, text: str, final: bool) -> ParsedOutput:
    pos = _skip(text, 0)
    args = _decode(text, pos) if pos < len(text) else None
    if args is not None:
        return ParsedOutput("", [ParsedCall(name, text[pos : args[1]], True)])
    if final:  # cut short: the forced call as far as it got (nothing at all: empty content)
        return ParsedOutput("", [ParsedCall(name, text[pos:], True)] if pos < len(text) else [])
    return ParsedOutput("", [ParsedCall(name, text[pos:].rstrip(_WS + "}"), False)])


def parse_tool_calls(mode: str, text: str, final: bool, name: str | None = None) -> ParsedOutput:
    """``text`` parsed by ``mode`` (a format above); ``final``: the text is complete."""
    if mode == "hermes":
        return parse_hermes(text, final)
    if mode == "llama3_json":
        return parse_llama3_json(text, final)
    if mode == "required":
        return parse_required(text, final)
    if mode == "named" and name is not None:
        return parse_named(name, text, final)
    raise ValueError(f"unknown tool call format {mode!r}")


def parser_for_template(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model (None: none cbserve knows)."""
    if not template:
        return None
    if _HERMES_OPEN in template:
        return "hermes"
    if _PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return None
