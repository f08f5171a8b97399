"""``/v1/responses`` (OpenAI's Responses API, as vLLM serves it) on top of the chat flow: a request becomes a
chat completion request (``input`` items as chat messages, ``instructions`` a system message first, function
tools and ``tool_choice``, ``text.format`` as ``response_format``, ``max_output_tokens`` as ``max_tokens``) that
``OpenAIServing.chat`` serves with everything chat has (template, tool parsing, structured output, reasoning
parser); its answer becomes a response object or the Responses' event stream (``responses_output.py``).

Stateless by default: only a request with ``store: true`` is kept (``response_store.py``: served, the app's store,
one for every ingress replica; bounded and with an expiry) for ``GET`` / ``DELETE /v1/responses/{id}`` and
``previous_response_id``, which puts the stored response's whole conversation (its input items and its output)
before the new input. A streamed response is stored before its ``response.completed`` event goes out. A field
this does not implement is refused with a 400 naming it, as chat's ``field_policy.py`` does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

from cbserve.frontend.protocol import APIError, ChatCompletionRequest, ChatCompletionResponse, now
from cbserve.frontend.responses.output import ResponseContext, ResponsesStream, output_items, response_object
from cbserve.frontend.responses.protocol import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    OtherItem,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponsesTool,
    ResponsesToolChoice,
    TextConfig,
    new_item_id,
)
from cbserve.frontend.responses.store import InMemoryResponses, StoredResponse, StoredResponses
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.validation import invalid_body_error

logger = logging.getLogger(__name__)

Harmless = Callable[[Any], bool]
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def _falsy(v: Any) -> bool:
    return not v


def _no_effort(v: Any) -> bool:
    return not v or all(x is None for x in v.values())


# field -> (why it is refused, which values are accepted anyway)
REFUSED: dict[str, tuple[str, Harmless]] = {
    "background": ("(background responses) is not supported", _falsy),
    "include": ("is not supported", _falsy),
    "max_tool_calls": ("is not supported", lambda v: v is None),
    "prompt": ("(prompt templates) is not supported", _falsy),
    "reasoning": ("is not supported: cbserve cannot budget a model's reasoning (with a reasoning parser, "
                  "chat_template_kwargs {\"enable_thinking\": false} turns Qwen3's thinking off)", _no_effort),
    "service_tier": ("only 'auto' and 'default' are supported", lambda v: v in (None, "auto", "default")),
    "truncation": ("only 'disabled' is supported", lambda v: v in (None, "disabled")),
    "top_logprobs": ("is not supported", _falsy),
    "conversation": ("(conversations) is not supported; chain responses with previous_response_id", _falsy),
    "stream_options": ("is not supported", lambda v: not v or set(v) <= {"include_obfuscation"}),
    "prompt_cache_key": ("is not supported (the router keeps a prompt prefix on one replica itself)", _falsy),
}
# fields of the chat request a Responses request sets as they are
_PASSED = ("model", "temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "seed", "stop",
           "priority", "cache_salt", "chat_template_kwargs", "prompt_cache_retention")  # fmt: skip
# a chat error's param, in the Responses request's words
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "stream_options": "stream"}  # fmt: skip


class ResponsesAPI:
    """``/v1/responses`` over ``serving`` (its ``chat``), keeping responses in ``store`` (the ingress gives the app's
    store; by default one in this process)."""

    def __init__(self, serving: OpenAIServing, store: StoredResponses | None = None) -> None:
        self.serving = serving
        self.store: StoredResponses = store if store is not None else InMemoryResponses()
        self._logged: set[str] = set()

    async def create(self, req: ResponsesRequest, request_id: str | None = None) -> ResponseObject | AsyncIterator[str]:
        """A response, or its SSE events when ``stream``. ``request_id``: the client's id (body ``request_id`` or
        the X-Request-Id header): the response id is ``resp_<id>``."""
        self._check_fields(req)
        history = await self._history(req.previous_response_id)
        items = (*history, *req.input)
        chat = chat_request(req, items, len(history))
        request_id = request_id or req.request_id
        rid = f"resp_{request_id}" if request_id else new_item_id("resp")
        ctx = ResponseContext(rid, now(), self.serving.model_name(req.model), req, items)
        try:
            answer = await self.serving.chat(chat, request_id)
        except APIError as e:
            raise _renamed(e) from None
        if not isinstance(answer, ChatCompletionResponse):
            return self._stream(ctx, answer)  # type: ignore[arg-type]
        choice = answer.choices[0]
        output = output_items(choice.message, choice.finish_reason == "length")
        response = response_object(ctx, output, answer.usage, choice.finish_reason)
        await self._keep(ctx, response)
        return response

    async def retrieve(self, response_id: str) -> ResponseObject:
        entry = await self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry.response

    async def delete(self, response_id: str) -> ResponseDeleted:
        if not await self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return ResponseDeleted(id=response_id)

    async def _stream(self, ctx: ResponseContext, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """The Responses' events of a streamed chat answer; the final response is stored (when asked) before its
        ``response.completed`` event goes out, so a client that reads it next finds it."""
        final: list[ResponseObject] = []
        events = ResponsesStream(ctx, final.append).events(lines)
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if final:
                    await self._keep(ctx, final.pop())
                yield event

    def _check_fields(self, req: ResponsesRequest) -> None:
        """APIError 400 for the first refused field the request sets; unknown extra fields logged once."""
        for name in sorted(req.model_fields_set):
            rule = REFUSED.get(name)
            if rule is not None and not rule[1](getattr(req, name)):
                raise APIError(400, f"{name} {rule[0]}", param=name)
        for name in sorted(req.model_extra or {}):
            if name not in self._logged:
                self._logged.add(name)
                logger.warning("ignoring unknown request field %r (ResponsesRequest); logged once", name)

    async def _history(self, previous_response_id: str | None) -> tuple[InputItem, ...]:
        if previous_response_id is None:
            return ()
        entry = await self.store.get(previous_response_id)
        if entry is None:
            raise _not_found(previous_response_id, "previous_response_id")
        return entry.items

    async def _keep(self, ctx: ResponseContext, response: ResponseObject) -> None:
        if ctx.request.store:
            output = _ITEMS.validate_python([item.model_dump() for item in response.output])
            await self.store.put(StoredResponse(response, (*ctx.items, *output)))


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param)


def _renamed(e: APIError) -> APIError:
    if e.param is not None:
        head, dot, rest = e.param.partition(".")
        e.param = _PARAMS.get(head, head) + dot + rest
    return e


# ---- a Responses request as a chat completion request -----------------------------------------------
def chat_request(req: ResponsesRequest, items: Sequence[InputItem], first_own: int) -> ChatCompletionRequest:
    """The chat completion request that answers ``req``: ``items`` (the chain's, the request's own from
    ``first_own``) as messages, after ``instructions``."""
    body: dict[str, Any] = {name: getattr(req, name) for name in _PASSED if name in req.model_fields_set}
    body.update(messages=chat_messages(req.instructions, items, first_own), stream=req.stream,
                parallel_tool_calls=req.parallel_tool_calls)  # fmt: skip
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    response_format = chat_response_format(req.text)
    if response_format is not None:
        body["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _renamed(invalid_body_error(e.errors())) from e


def chat_messages(instructions: str | None, items: Sequence[InputItem], first_own: int) -> list[dict[str, Any]]:
    """Input items as chat messages: a message as itself (``developer``: ``system``), function calls as an
    assistant message's ``tool_calls`` (after the text of the same answer), a call's output as a ``tool``
    message; reasoning items are left out (chat templates drop earlier turns' reasoning)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"input[{i - first_own}]" if i >= first_own else "previous_response_id"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            msgs.append({"role": role, "content": _text(item.content, where)})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            msg = {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)}
            if item.call_id in names:
                msg["name"] = names[item.call_id]
            msgs.append(msg)
        elif isinstance(item, OtherItem):
            raise APIError(400, f"{where}: item type {item.type!r} is not supported", param=where)
    if not msgs:
        raise APIError(400, "input holds no message", param="input")
    return msgs


def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise APIError(400, f"{where}.content[{j}]: content type {part.type!r} is not supported (text-only "
                           "models: input_text)", param=f"{where}.content")  # fmt: skip
        parts.append(part.text)
    return "".join(parts)


def chat_tools(tools: Sequence[ResponsesTool]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise APIError(400, f"tools[{i}]: tool type {tool.type!r} is not supported (function tools only)",
                           param="tools")  # fmt: skip
        if not tool.name:
            raise APIError(400, f"tools[{i}]: a function tool needs a name", param="tools")
        fn = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
              "strict": tool.strict}  # fmt: skip
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def chat_tool_choice(choice: str | ResponsesToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise APIError(400, f"tool_choice type {choice.type!r} is not supported (give 'none', 'auto', "
                       "'required' or {\"type\": \"function\", \"name\": ...})", param="tool_choice")  # fmt: skip
    return {"type": "function", "function": {"name": choice.name}}


def chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if text.verbosity not in (None, "medium"):
        raise APIError(400, "text.verbosity is not supported", param="text.verbosity")
    fmt = text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise APIError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
    schema = {"name": fmt.name or "response", "description": fmt.description, "schema": fmt.json_schema,
              "strict": fmt.strict}  # fmt: skip
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
