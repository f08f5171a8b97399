"""Pydantic models of OpenAI's Responses API (``/v1/responses``) as cbserve serves it: the request (``input``
as a string or items, function tools in the Responses' flat shape, ``text.format``), and the response object
with its output items (reasoning, message, function call). The stream's events are built from these items in
``responses_stream.py``; ``responses_api.py`` translates a request into a chat completion and back. Every field
of OpenAI's request is declared: honoured, or refused with a 400 naming it when set (``responses_api.py``).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from cbserve.frontend.protocol import now


def new_item_id(prefix: str) -> str:
    """OpenAI's id shape: ``resp_...``, ``msg_...``, ``rs_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input items ----------------------------------------------------------------------------------
class ContentPart(BaseModel):
    """A part of a message's content: ``input_text`` (``output_text`` in an assistant's earlier answer); other
    types (images, files, audio) are refused: cbserve serves text-only models."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")  # an earlier output's id and status

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(BaseModel):
    """A function call of an earlier answer (the client sends it back with its output)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(BaseModel):
    """An earlier answer's reasoning sent back: accepted and left out of the prompt (chat templates drop the
    reasoning of earlier turns)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None


class OtherItem(BaseModel):
    """Any other item type (``item_reference``, hosted tools' calls): refused with a 400 naming it."""

    model_config = ConfigDict(extra="allow")

    type: str


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in _ITEM_TYPES else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_tag),
]


def _one_message(value: Any) -> Any:
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


# ``input``: a string is one user message (validated as the list, so a bad item's error names it alone)
Input = Annotated[list[InputItem], BeforeValidator(_one_message), Field(description="a string, or a list of items")]


# ---- tools and text format ------------------------------------------------------------------------
class ResponsesTool(BaseModel):
    """A function tool in the Responses' flat shape; other tool types (web search, file search, MCP, ...)
    are refused with a 400 naming them."""

    model_config = ConfigDict(extra="allow")

    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(BaseModel):
    """``{"type": "function", "name": ...}``; other types (hosted tools, ``allowed_tools``) are refused."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = None  # refused unless "medium" (the default)


# ---- the request ----------------------------------------------------------------------------------
class ResponsesRequest(BaseModel):
    """OpenAI's ``POST /v1/responses`` body, with vLLM's sampling extras (passed to the chat request)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Input
    instructions: str | None = None  # a system message first; not carried over by previous_response_id
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = False  # stateless unless asked: kept in the app's bounded store
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # declared so they are documented; refused when set (responses_api.py)
    background: bool | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    conversation: str | dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


# ---- the response ---------------------------------------------------------------------------------
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: new_item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputReasoning(BaseModel):
    id: str = Field(default_factory=lambda: new_item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "completed"


class OutputFunctionCall(BaseModel):
    id: str = Field(default_factory=lambda: new_item_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    """The response (``object: "response"``); the request's settings are echoed as OpenAI does."""

    id: str = Field(default_factory=lambda: new_item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "completed"
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    user: str | None = None
    store: bool = False
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["default"] = "default"


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
