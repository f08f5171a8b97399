"""Pydantic models of the OpenAI-compatible API (the subset cbserve serves): requests are parsed into them
(and mapped to SamplingParams), responses and stream chunks are built from them, and the ingress declares
them on its routes so that ``/openapi.json`` documents the real bodies. Every field of OpenAI's API (and
vLLM's extras) is declared: honoured, or refused with a 400 naming it when set (``field_policy.py``).
Unknown extra fields are kept aside (``model_extra``), logged once per name and otherwise ignored."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from cbserve.frontend.protocol_tools import (
    DeltaToolCall,
    ResponseFormat,
    RetentionDirective,
    StructuredOutputsParams,
    Tool,
    ToolCall,
    ToolChoice,
)


class APIError(Exception):
    """An error answered in OpenAI's body shape with an HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[int, str, str, str | None]]:
        """Pickled whole (it crosses Ray calls, e.g. from the shared LoRA store)."""
        return APIError, (self.status, self.message, self.type, self.param)

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body (also sent as an SSE event when a stream fails after it started)."""

    error: ErrorInfo


# ---- requests -------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # nothing to obfuscate against: accepted, no effect
    continuous_usage_stats: bool = False  # vLLM's; refused when true (field_policy.py)


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (vLLM-style extras included)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0  # lower runs first (needs the "priority" ordering)
    cache_salt: str | None = None  # prefix-cache entries are shared only between requests of one salt
    request_id: str | None = None  # echoed in the response id and the X-Request-Id header
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens (-1: max_model_len)
    # declared so they are documented; field_policy.py refuses (or accepts only the harmless values of) them
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    prompt_embeds: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # OpenAI's: "24h" keeps the whole prompt (retention hints)
    retention_directives: list[RetentionDirective] | None = None  # ranges of the prompt to keep cached
    safety_identifier: str | None = None
    # structured output (frontend/tools/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older guided decoding fields: declared, refused (field_policy.py) in favour of structured_outputs
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt (and its logprobs) alone
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"unsupported content part type {part.get('type')!r}", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    add_special_tokens: bool = False  # the template adds them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # declared so they are documented; field_policy.py refuses them when set
    echo: bool = False
    documents: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # tool calling (frontend/tools/calls.py)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache or its tiers


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry: one per token id (the prompt token and the top alternatives)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with ``return_token_ids`` (vLLM's): an RL loop's rollout
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    weights_version: int | None = None  # cbserve's: the weights' version that produced it (0: the model's files)
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's answer to do_remote_decode (vLLM's)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # the thinking of a model served with a reasoning parser (``reasoning.py``); ``reasoning`` is vLLM's newer
    # name for the same text. Left out of the body when there is none.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_reasoning(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        drop = {"reasoning_content", "reasoning"} if self.reasoning_content is None else set()
        return {k: v for k, v in handler(self).items() if k not in drop}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    weights_version: int | None = None  # cbserve's: the weights' version that produced the output (update_weights)
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's answer to do_remote_decode (vLLM's)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # a piece of the thinking (``reasoning``: the same, vLLM's newer name)
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A delta carries only what changed: ``{"content": "..."}`` after the first chunk."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    weights_version: int | None = None  # cbserve's, on a chunk that ends a choice (as ChatCompletionResponse's)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "cbserve"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter: its path (vLLM's shape)
    parent: str | None = None  # a LoRA adapter: the served model it runs on


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
