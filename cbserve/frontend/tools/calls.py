"""Tool calls of one chat choice, as OpenAI sends them: whole (``final_message``) or as stream deltas
(``ToolCallStream``): a call's first delta carries its index, id, type and name with empty arguments, the
next ones pieces of its arguments, and the finishing chunk says ``finish_reason: "tool_calls"``."""

from __future__ import annotations

from dataclasses import dataclass, field

from cbserve.frontend.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall, new_call_id
from cbserve.frontend.tools.parsers import ParsedOutput, parse_tool_calls
from cbserve.frontend.tools.structured import ToolMode


def _parse(mode: ToolMode, text: str, final: bool) -> ParsedOutput:
    parsed = parse_tool_calls(mode.format, text, final, mode.name)
    if not mode.parallel and len(parsed.calls) > 1:
        parsed.calls = parsed.calls[:1]
    return parsed


def finish_reason_with_calls(finish: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and finish == "stop" else finish


def final_message(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished answer. Text that holds no complete call stays content."""
    parsed = _parse(mode, text, final=True)
    calls = [ToolCall(function=FunctionCall(name=c.name or "", arguments=c.arguments)) for c in parsed.complete_calls]
    if not calls:
        return text, []
    content = parsed.content.strip()
    return (content or None), calls


@dataclass
class _Sent:
    id: str
    name_sent: bool = False
    arguments: str = ""


@dataclass
class ToolCallStream:
    """One choice's stream: feed each new piece of text; get the content and tool-call deltas to send."""

    mode: ToolMode
    text: str = ""
    content_sent: int = 0
    calls: list[_Sent] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return any(c.name_sent for c in self.calls)

    def feed(self, new_text: str, final: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += new_text
        parsed = _parse(self.mode, self.text, final)
        if final and not parsed.complete_calls:  # nothing parsed as a call: the rest is content
            parsed = ParsedOutput(self.text)
        content = None
        if len(parsed.content) > self.content_sent and not self.has_calls:
            content = parsed.content[self.content_sent :]
            self.content_sent = len(parsed.content)
        deltas = []
        for i, call in enumerate(parsed.calls):
            if final and not call.complete:
                break
            if i == len(self.calls):
                self.calls.append(_Sent(new_call_id()))
            sent = self.calls[i]
            if call.name is None:
                break
            name = None
            if not sent.name_sent:
                sent.name_sent, name = True, call.name
            piece = ""
            if call.arguments.startswith(sent.arguments):
                piece, sent.arguments = call.arguments[len(sent.arguments) :], call.arguments
            if name is None and not piece:
                continue
            deltas.append(
                DeltaToolCall(
                    index=i, id=sent.id if name else None, type="function" if name else None,
                    function=DeltaFunctionCall(name=name, arguments=piece),
                )
            )
        return content, deltas
