"""The output side of ``/v1/responses``: a chat completion's answer as the Responses' output items (reasoning,
message, function calls) and response object (``output_items``, ``response_object``), and a streamed chat
completion's chunks as the Responses' SSE events (``ResponsesStream``), in the official order:

``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``, its content
part (``response.content_part.added``, ``response.reasoning_text.delta`` or ``response.output_text.delta`` pieces,
their ``.done``, ``response.content_part.done``) or its arguments (``response.function_call_arguments.delta``
pieces and ``.done``), ``response.output_item.done``; and ``response.completed`` with the whole response (its
status ``incomplete`` when ``max_output_tokens`` cut it, as vLLM does, so clients waiting for
``response.completed`` finish). An error after the stream started is an ``error`` event then ``response.failed``.
Each event is ``event: <type>`` and ``data: <json>`` with a ``sequence_number``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cbserve.frontend.protocol import ChatResponseMessage, UsageInfo
from cbserve.frontend.protocol_tools import new_call_id
from cbserve.frontend.responses.protocol import (
    IncompleteDetails,
    InputItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)


@dataclass(frozen=True)
class ResponseContext:
    """One response being made: its id, creation time, model name, request, and the conversation it
    continues (every input item of its chain, its own last) for the store."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest
    items: tuple[InputItem, ...]


def output_items(message: ChatResponseMessage, incomplete: bool) -> list[OutputItem]:
    """A chat answer's message as output items: its reasoning, its text, its tool calls (the last item
    ``incomplete`` when the length limit cut the answer). An answer with nothing in it is an empty message."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(OutputReasoning(content=[ReasoningText(text=message.reasoning_content)]))
    if message.content or (message.content is not None and not message.tool_calls):
        items.append(OutputMessage(content=[OutputText(text=message.content)]))
    for call in message.tool_calls or []:
        items.append(OutputFunctionCall(call_id=call.id, name=call.function.name, arguments=call.function.arguments))
    if not items:
        items.append(OutputMessage(content=[OutputText()]))
    if incomplete:
        items[-1].status = "incomplete"
    return items


def response_object(
    ctx: ResponseContext, output: Sequence[OutputItem], usage: UsageInfo | None, finish: str | None,
    status: str | None = None,
) -> ResponseObject:
    """The response object, the request's settings echoed. ``status``: "in_progress" / "failed" while
    streaming; else from ``finish``: "incomplete" (``max_output_tokens``) after a length finish."""
    req = ctx.request
    incomplete = status is None and finish == "length"
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    text.setdefault("format", {"type": "text"})
    choice = req.tool_choice
    return ResponseObject(
        id=ctx.id, created_at=ctx.created_at, model=ctx.model, output=list(output),
        status=status or ("incomplete" if incomplete else "completed"),
        incomplete_details=IncompleteDetails() if incomplete else None,
        usage=None if usage is None else ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens
        ),
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata,
        parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
        temperature=req.temperature, top_p=req.top_p, user=req.user, store=req.store, text=text,
        tool_choice="auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump(),
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
    )  # fmt: skip


def _chunk_of(line: str) -> dict[str, Any] | None:
    """The JSON body of one chat SSE line (None for ``[DONE]`` and anything that is not data)."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :].strip()
    return None if data == "[DONE]" else json.loads(data)


async def _after(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for line in rest:
        yield line


class ResponsesStream:
    """A streamed chat completion's SSE lines as the Responses' events. ``on_done`` gets the final response
    (the API stores it when asked)."""

    def __init__(self, ctx: ResponseContext, on_done: Callable[[ResponseObject], None]) -> None:
        self.ctx = ctx
        self.on_done = on_done
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None  # the item the next deltas go to
        self.calls: dict[int, OutputFunctionCall] = {}  # by the chat tool call's index
        self.finish: str | None = None
        self.usage: UsageInfo | None = None

    async def events(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """Closed early (the client went away), it closes the chat stream at once, which aborts the request."""
        async with contextlib.aclosing(lines):  # type: ignore[type-var]
            first = await anext(lines, "")  # the chat's first chunk (no token yet): started, it cleans up when closed
            snapshot = self._response("in_progress").model_dump()
            yield self._event("response.created", response=snapshot)
            yield self._event("response.in_progress", response=snapshot)
            async for line in _after(first, lines):
                chunk = _chunk_of(line)
                if chunk is not None and "error" in chunk:
                    for event in self._failed(chunk["error"]):
                        yield event
                    return
                for event in self._apply(chunk or {}):
                    yield event
            for event in self._finish():
                yield event
            final = self._response()
            self.on_done(final)
            yield self._event("response.completed", response=final.model_dump())

    def _response(self, status: str | None = None) -> ResponseObject:
        items = [] if status == "in_progress" else self.items
        return response_object(self.ctx, items, self.usage, self.finish, status)

    def _event(self, type_: str, **fields: Any) -> str:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _apply(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = UsageInfo.model_validate(chunk["usage"])
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _add(self, item: OutputItem) -> list[str]:
        out = self._close()
        self.items.append(item)
        self.open = item
        return [*out, self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=item.model_dump())]  # fmt: skip

    def _reasoning(self, text: str) -> list[str]:
        out: list[str] = []
        item = self.open
        if not isinstance(item, OutputReasoning):
            item = OutputReasoning(status="in_progress")
            out += self._add(item)
            item.content.append(ReasoningText())
            out.append(self._event("response.content_part.added", **self._where(item), content_index=0,
                                   part=item.content[0].model_dump()))  # fmt: skip
        item.content[0].text += text
        return [*out, self._event("response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)]

    def _message(self) -> tuple[OutputMessage, list[str]]:
        if isinstance(self.open, OutputMessage):
            return self.open, []
        item = OutputMessage(status="in_progress")
        out = self._add(item)
        item.content.append(OutputText())
        part = item.content[0].model_dump()
        return item, [*out, self._event("response.content_part.added", **self._where(item), content_index=0, part=part)]

    def _text(self, text: str) -> list[str]:
        item, out = self._message()
        item.content[0].text += text
        return [*out, self._event("response.output_text.delta", **self._where(item), content_index=0, delta=text,
                                  logprobs=[])]  # fmt: skip

    def _call(self, delta: dict[str, Any]) -> list[str]:
        fn = delta.get("function") or {}
        out: list[str] = []
        item = self.calls.get(delta["index"])
        if item is None:
            call_id = delta.get("id") or new_call_id()
            item = self.calls[delta["index"]] = OutputFunctionCall(call_id=call_id, name=fn.get("name") or "",
                                                                    status="in_progress")  # fmt: skip
            out += self._add(item)
        piece = fn.get("arguments") or ""
        if piece:
            item.arguments += piece
            out.append(self._event("response.function_call_arguments.delta", **self._where(item), delta=piece))
        return out

    def _finish(self) -> list[str]:
        """The last item closed; an answer with nothing in it is one empty message, as a whole answer's."""
        out = [] if self.items else self._message()[1]
        return out + self._close("incomplete" if self.finish == "length" else "completed")

    def _close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status  # type: ignore[assignment]
        where = self._where(item)
        if isinstance(item, OutputFunctionCall):
            out = [self._event("response.function_call_arguments.done", **where, name=item.name,
                               arguments=item.arguments)]  # fmt: skip
        else:
            part = item.content[0]
            done = ("response.reasoning_text.done", {}) if isinstance(item, OutputReasoning) else (
                "response.output_text.done", {"logprobs": []})
            out = [self._event(done[0], **where, content_index=0, text=part.text, **done[1]),
                   self._event("response.content_part.done", **where, content_index=0, part=part.model_dump())]
        return [*out, self._event("response.output_item.done", output_index=where["output_index"],
                                  item=item.model_dump())]  # fmt: skip

    def _failed(self, error: dict[str, Any]) -> list[str]:
        message = str(error.get("message", "the request failed"))
        code = error.get("code")
        out = [self._event("error", code=None if code is None else str(code), message=message,
                           param=error.get("param"))]  # fmt: skip
        failed = self._response("failed")
        failed.error = {"code": "server_error", "message": message}
        return [*out, self._event("response.failed", response=failed.model_dump())]
