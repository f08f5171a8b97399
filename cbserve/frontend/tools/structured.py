"""Structured output and tool choice at the front end: a request's ``response_format`` /
``structured_outputs`` / forced ``tool_choice`` as the StructuredSpec its SamplingParams carry, tools as
the chat template sees them, and grammar validation (a spec that does not compile is a 400 naming it).

``tool_choice``: "none" (tools go to the template, the output is plain content), "auto" (the model's own
tool-call format is parsed, ``tool_parsers.py``; needs a parser, from the config or the chat template),
"required" (a JSON schema forces a list of one or more calls of the given tools) or a named function (a
JSON schema forces its arguments). Forced choices hold on any model, whatever its template.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbserve.frontend.protocol import APIError, ChatCompletionRequest, SamplingFields
from cbserve.frontend.protocol_tools import NamedToolChoice, Tool
from cbserve.frontend.tools.parsers import TOOL_CALL_PARSERS, parser_for_template
from cbserve.scheduler.requests.sampling_params import StructuredSpec

TOOL_CALL_PARSER_CHOICES = ("auto", "none", *TOOL_CALL_PARSERS)


@dataclass(frozen=True)
class ToolMode:
    """How a chat answer's text becomes tool calls: ``format`` is one of tool_parsers' formats."""

    format: str  # "hermes" | "llama3_json" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True  # False: at most one call is returned


def resolve_tool_parser(setting: str, chat_template: str | None) -> str | None:
    """The ``tool_call_parser`` config value as a parser name ("auto": from the chat template; "none" or
    a template without a known format: None, and ``tool_choice="auto"`` with tools is refused)."""
    if setting not in TOOL_CALL_PARSER_CHOICES:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSER_CHOICES}, got {setting!r}")
    if setting == "auto":
        return parser_for_template(chat_template if isinstance(chat_template, str) else None)
    return None if setting == "none" else setting


def request_spec(req: SamplingFields) -> tuple[StructuredSpec | None, str | None]:
    """The spec of ``response_format`` or ``structured_outputs`` (at most one of them), and the field."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    if so is not None:
        return _structured_outputs_spec(so), "structured_outputs"
    if rf is None or rf.type == "text":
        return None, None
    if rf.type == "json_object":
        return StructuredSpec("json_object"), "response_format"
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return StructuredSpec("json", json.dumps(rf.json_schema.json_schema)), "response_format"


def any_whitespace(req: SamplingFields, disable_any_whitespace: bool) -> bool:
    """Whether a request's JSON may hold any whitespace between its tokens: its ``structured_outputs.
    disable_any_whitespace`` when set, else the server's (``disable_any_whitespace``)."""
    so = req.structured_outputs
    if so is not None and so.disable_any_whitespace is not None:
        return not so.disable_any_whitespace
    return not disable_any_whitespace


def _structured_outputs_spec(so: Any) -> StructuredSpec:
    given = {
        "json": so.json_, "json_object": so.json_object or None, "regex": so.regex, "choice": so.choice,
        "grammar": so.grammar,
    }  # fmt: skip
    set_ = [k for k, v in given.items() if v is not None]
    if len(set_) != 1:
        raise APIError(400, f"structured_outputs needs exactly one of {sorted(given)}, got {set_}",
                       param="structured_outputs")  # fmt: skip
    kind, value = set_[0], given[set_[0]]
    if kind == "json":
        return StructuredSpec("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return StructuredSpec("choice", json.dumps(value))
    return StructuredSpec(kind, "" if kind == "json_object" else value)


# ---- tools ----------------------------------------------------------------------------------------
def chat_constraints(
    req: ChatCompletionRequest, parser: str | None
) -> tuple[list[dict[str, Any]] | None, ToolMode | None, StructuredSpec | None, str | None]:
    """A chat request's tools for the template, how to read its tool calls (``tool_setup``), and the one spec its
    output follows with the field that asked for it: a forced tool choice's ("tools") or ``request_spec``'s."""
    tools, tool_mode, tool_spec = tool_setup(req, parser)
    spec, param = request_spec(req)
    if tool_spec is not None and spec is not None:
        raise APIError(400, f"a forced tool_choice cannot be combined with {param}", param="tool_choice")
    return (tools, tool_mode, tool_spec, "tools") if tool_spec is not None else (tools, tool_mode, spec, param)


def tool_setup(
    req: ChatCompletionRequest, parser: str | None
) -> tuple[list[dict[str, Any]] | None, ToolMode | None, StructuredSpec | None]:
    """The tools for the chat template, how to read tool calls from the answer, and the spec a forced
    tool choice adds."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None, None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool function names must be unique", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return template_tools, None, None
    if choice == "auto":
        if parser is None:
            raise APIError(
                400, "tool_choice 'auto' needs a tool-call parser, and this model's chat template has no "
                "tool-call format cbserve knows: set tool_call_parser in the config, or use tool_choice "
                "'required' or a named function", param="tool_choice",
            )  # fmt: skip
        return template_tools, ToolMode(parser, parallel=req.parallel_tool_calls), None
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice")  # fmt: skip
        spec = StructuredSpec("json", json.dumps(_parameters(tool)))
        return template_tools, ToolMode("named", tool.function.name), spec
    spec = StructuredSpec("json", json.dumps(required_calls_schema(tools, req.parallel_tool_calls)))
    return template_tools, ToolMode("required", parallel=req.parallel_tool_calls), spec


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def required_calls_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls (one at most unless ``parallel``), each of one of ``tools``."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    schema["items"] = items[0] if len(items) == 1 else {"anyOf": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- grammar validation ---------------------------------------------------------------------------
class GrammarValidator:
    """Compiles each spec once, as the workers will (same compiler, built on the first structured request:
    it imports xgrammar, and torch with it), so a spec that does not compile is a 400 here. Thread-safe:
    the server calls it in a worker thread, off the event loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = [*stop_token_ids, *([eos] if eos is not None else [])]
        self._cache: Any = None
        self._lock = threading.Lock()
        self._spaced: OrderedDict[StructuredSpec, StructuredSpec] = OrderedDict()

    def check(self, spec: StructuredSpec | None, param: str | None) -> None:
        if spec is None:
            return
        from cbserve.worker.sampling.structured import GrammarCompilerCache, GrammarError

        try:
            with self._lock:
                if self._cache is None:
                    self._cache = GrammarCompilerCache(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._cache.get(spec)
        except GrammarError as e:
            raise APIError(400, str(e), param=param) from e

    def spaced(self, spec: StructuredSpec, param: str | None) -> StructuredSpec:
        """A JSON spec (``json``, ``json_object``) as the EBNF grammar of the same JSON with any whitespace
        between its tokens (xgrammar's ``any_whitespace``; the workers compile JSON specs in one fixed layout,
        ``{"a": 1, "b": [2, 3]}``); other specs as they are. A schema that does not convert is a 400."""
        if spec.kind not in ("json", "json_object"):
            return spec
        with self._lock:
            hit = self._spaced.get(spec)
        if hit is not None:
            return hit
        import xgrammar as xgr

        schema = spec.spec if spec.kind == "json" else '{"type": "object"}'
        try:
            json.loads(schema)
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=True)
        except Exception as e:  # malformed JSON, or xgrammar's message on a schema it cannot convert
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise APIError(400, f"invalid {spec.kind} for structured output: {first}", param=param) from e
        out = StructuredSpec("grammar", str(grammar))
        with self._lock:
            self._spaced[spec] = out
            if len(self._spaced) > 256:
                self._spaced.popitem(last=False)
        return out
