"""Request validation and prompt building for the OpenAI server: the body parsed into its protocol model,
the model name checked, prompts turned into token ids (text, token ids within the vocabulary, chat
messages through the chat template), lengths checked (``scheduler.limits``, the engine's own rule) and the
request's SamplingParams built. A chat completion request becomes its engine inputs in one call
(``RequestValidator.chat``: its tools and structured output, the grammar checked off the event loop, the prompt,
the reasoning gate, the SamplingParams). Every problem is an APIError naming the field (HTTP 400, 404 for a
model)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from cbserve.frontend.field_policy import FieldPolicy
from cbserve.frontend.lora_registry import LoRARegistry
from cbserve.frontend.protocol import APIError, ChatCompletionRequest, ChatMessage, SamplingFields
from cbserve.frontend.text.tokenizer import apply_chat_template
from cbserve.frontend.tools.reasoning import ReasoningMode, gated_spec, request_mode, resolve_reasoning_parser
from cbserve.frontend.tools.structured import (
    GrammarValidator,
    ToolMode,
    any_whitespace,
    chat_constraints,
    resolve_tool_parser,
)
from cbserve.scheduler.errors import RequestRejectedError
from cbserve.scheduler.requests.kv_transfer import KVTransferParams
from cbserve.scheduler.requests.limits import resolve_max_tokens
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.sampling_params import SamplingParams, StructuredSpec
from cbserve.worker.loading.pooling_config import PoolingConfig

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the served name, the context length the engines use, the
    largest n / best_of, the vocabulary size (token-id prompts must stay inside it), the
    ``tool_call_parser`` and ``reasoning_parser`` settings ("auto": from the chat template) and whether
    JSON output keeps one fixed layout unless a request asks otherwise (``disable_any_whitespace``); the
    ``runner`` ("pooling": embeddings only) and a pooling model's ``pooling`` (``read_pooling_config``)."""

    name: str
    max_model_len: int
    max_n: int
    vocab_size: int
    priority_ordering: bool = False  # the engines order by request priority (else ``priority`` is refused)
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None  # None / "none": off
    disable_any_whitespace: bool = True
    runner: str = "generate"
    pooling: PoolingConfig | None = None
    retention_priority: int = 50  # of cache_control and prompt_cache_retention (kv_retention_cache_control_priority)
    retention_max_s: float = 3600.0  # the longest a hint may ask (kv_retention_max_duration_s)


def invalid_body_error(errors: Sequence[Any], strip: tuple[str, ...] = ()) -> APIError:
    """The 400 for a body that failed validation, naming the first bad field (``errors``: pydantic's, or
    FastAPI's, whose locations start with ``strip``)."""
    err = dict(errors[0]) if errors else {}
    loc = [str(p) for p in err.get("loc", ())]
    loc = loc[len(strip):] if tuple(loc[: len(strip)]) == strip else loc
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error") or err.get("msg")
        return APIError(400, f"malformed JSON body: {detail}")
    if kind in ("model_attributes_type", "dict_type") or (kind in ("missing", "model_type") and not loc):
        return APIError(400, "the request body must be a JSON object")
    if not loc:  # the body as a whole (a check across fields)
        return APIError(400, str(err.get("msg", "invalid request body")))
    name = ".".join(loc)
    return APIError(400, f"{name}: {err.get('msg')}", param=name)


@dataclass
class ChatInputs:
    """What a chat completion request becomes (``RequestValidator.chat``)."""

    lora: LoRARequest | None  # the adapter its ``model`` names
    prompt: list[int]
    params: SamplingParams
    tools: list[dict[str, Any]] | None  # as the chat template got them
    tool_mode: ToolMode | None  # how its answers' tool calls are read
    reasoning: ReasoningMode | None  # how its answers split into reasoning and content
    logprobs: int | None  # top logprobs per token (None: none)


class RequestValidator:
    """``loras``: the adapters a request's ``model`` may name besides the served model (none by default);
    ``eos_token_ids``: the tokens a grammar lets end the output."""

    def __init__(self, served: ServedModel, tokenizer: Any, loras: LoRARegistry | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.served = served
        self.tokenizer = tokenizer
        self.fields = FieldPolicy()
        self.loras = loras if loras is not None else LoRARegistry(served.name)
        self.grammars = GrammarValidator(tokenizer, served.vocab_size, eos_token_ids)
        template = getattr(tokenizer, "chat_template", None)
        self.tool_parser = resolve_tool_parser(served.tool_call_parser, template)
        self.reasoning_parser = resolve_reasoning_parser(served.reasoning_parser, template)

    async def chat(self, req: ChatCompletionRequest) -> ChatInputs:
        """A chat completion request's engine inputs, checked: the model and fields, its logprobs, its tools and
        structured output (the grammar compiled off the event loop: a 400 when it does not compile), the prompt,
        the reasoning gate and the SamplingParams."""
        lora = self.check_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        check_prompt_logprobs(req.prompt_logprobs, req.stream)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tools, tool_mode, spec, param = chat_constraints(req, self.tool_parser)
        spec = await self.checked_spec(spec, param, req)
        prompt = self.chat_request_prompt(req, tools)
        reasoning, spec = self._reasoning(req, prompt, spec)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, len(prompt), max_tokens, logprobs, req.prompt_logprobs, spec)
        return ChatInputs(lora, prompt, params, tools, tool_mode, reasoning, logprobs)

    async def checked_spec(self, spec: StructuredSpec | None, param: str | None,
                           req: SamplingFields) -> StructuredSpec | None:
        """The spec the engine gets, compiled off the event loop (a 400 when it does not compile): JSON
        with any whitespace unless the request (or else the server) disables it."""
        if spec is None:
            return None
        if any_whitespace(req, self.served.disable_any_whitespace):
            spec = await asyncio.to_thread(self.grammars.spaced, spec, param)
        await asyncio.to_thread(self.grammars.check, spec, param)
        return spec

    def _reasoning(self, req: ChatCompletionRequest, prompt: list[int], spec: StructuredSpec | None
                   ) -> tuple[ReasoningMode | None, StructuredSpec | None]:
        """How the request's answers split into reasoning and content (None: no reasoning parser, or
        thinking is off; the prompt's end says whether the output starts inside the reasoning), and the spec
        the engine gets: a grammar starts after the reasoning (``reasoning.gated_spec``), or from the first
        token where the vocabulary has no single tokens for the tags."""
        if self.reasoning_parser is None:
            return None, spec
        tail = self.tokenizer.decode(prompt[-16:])
        mode = request_mode(self.reasoning_parser, tail, req.chat_template_kwargs)
        if spec is None or mode is None:
            return mode, spec
        gated = gated_spec(spec, mode, self.tokenizer)
        if gated is None:
            return request_mode(self.reasoning_parser, tail, req.chat_template_kwargs, constrained=True), spec
        return mode, gated

    def check_request(self, req: SamplingFields) -> LoRARequest | None:
        """The model name (the adapter it names, if any), refused fields (400 naming them), unknown fields
        (logged once), priority."""
        lora = self.check_model(req.model)
        self.fields.check(req)
        if req.priority != 0 and not self.served.priority_ordering:
            raise APIError(400, "priority needs a server started with ordering='priority'", param="priority")
        return lora

    def kv_transfer(self, req: SamplingFields, num_prompts: int) -> KVTransferParams | None:
        """The request's part in prefill/decode disaggregation (vLLM's ``kv_transfer_params``; a 400 naming what is
        wrong): one prompt, and the prefill side's answer comes in a response, not a stream."""
        try:
            kt = KVTransferParams.from_json(req.kv_transfer_params)
        except ValueError as e:
            raise APIError(400, str(e), param="kv_transfer_params") from e
        if kt is not None and num_prompts != 1:
            raise APIError(400, "kv_transfer_params applies to a request of one prompt", param="kv_transfer_params")
        if kt is not None and kt.remote_decode and req.stream:
            raise APIError(400, "kv_transfer_params do_remote_decode answers in a response: set stream to false",
                           param="kv_transfer_params")
        return kt

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the served model); a 404 naming an unknown one."""
        return self.loras.resolve(model)

    # ---- prompts ------------------------------------------------------------------------------
    def completion_prompts(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        """A completion's ``prompt`` (text, token ids, or a list of either) as token-id prompts."""
        if isinstance(prompt, str):
            return [self.encode(prompt, add_special_tokens)]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [self.checked_ids(prompt)]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return [self.encode(p, add_special_tokens) if isinstance(p, str) else self.checked_ids(p) for p in prompt]

    def checked_ids(self, ids: list[int]) -> list[int]:
        """Token-id prompts must name tokens of the vocabulary (an out-of-range id would crash the forward)."""
        vocab = self.served.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in the prompt is outside the vocabulary [0, {vocab})", param="prompt")
        return list(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]) if text else []

    def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt of chat ``messages`` (assistant ``tool_calls`` and ``tool`` messages included) and
        ``tools``, rendered by the chat template."""
        try:
            msgs = [template_message(m) for m in messages]
            kwargs = {} if tools is None else {"tools": tools}
            return apply_chat_template(self.tokenizer, msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def chat_request_prompt(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A chat request's prompt: its messages (assistant ``tool_calls`` and ``tool`` messages included)
        and ``tools`` through the chat template (``chat_template`` replaces the model's;
        ``chat_template_kwargs`` reach it; ``continue_final_message`` leaves the last message open)."""
        if req.continue_final_message and req.add_generation_prompt:
            msg = "continue_final_message needs add_generation_prompt=false"
            raise APIError(400, msg, param="continue_final_message")
        kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
        for key in ("tokenize", "messages", "conversation", "add_generation_prompt", "continue_final_message"):
            if key in kwargs:
                raise APIError(400, f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs")
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        if req.chat_template is not None:
            kwargs["chat_template"] = req.chat_template
        if tools is not None:
            if "tools" in kwargs:
                raise APIError(400, "give tools, not chat_template_kwargs.tools", param="chat_template_kwargs")
            kwargs["tools"] = tools
        ids = self.render(req.messages, req.add_generation_prompt, req.add_special_tokens, kwargs)
        return self.truncated(ids, req.truncate_prompt_tokens)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, add_special_tokens: bool,
                kwargs: dict[str, Any]) -> list[int]:
        msgs = [template_message(m) for m in messages]  # a malformed tool call: a 400 of its own
        try:
            return apply_chat_template(self.tokenizer, msgs, add_generation_prompt, add_special_tokens, **kwargs)
        except Exception as e:  # the template's own errors (jinja, a missing variable, a bad message)
            raise APIError(400, f"the chat template failed: {e}", param="messages") from e

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """``truncate_prompt_tokens``: the last ``keep`` tokens (-1: max_model_len) of a prompt."""
        if keep is None:
            return ids
        limit = self.served.max_model_len
        if keep > limit:
            raise APIError(400, f"truncate_prompt_tokens must be <= {limit}", param="truncate_prompt_tokens")
        keep = limit if keep == -1 else keep
        return ids[-keep:] if keep else []

    # ---- sampling -----------------------------------------------------------------------------
    def sampling_params(
        self, req: SamplingFields, num_prompt: int, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None = None, structured: StructuredSpec | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams for a prompt of ``num_prompt`` tokens (an unset ``max_tokens``:
        all the room left in the context)."""
        try:
            max_tokens = resolve_max_tokens(num_prompt, max_tokens, self.served.max_model_len)
        except RequestRejectedError as e:
            raise APIError(400, str(e), param=e.param) from e
        if max(req.n, req.best_of or 0) > self.served.max_n:
            raise APIError(400, f"n (and best_of) must be <= {self.served.max_n}", param="n")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError(400, "best_of > n cannot be streamed", param="best_of")
        constraints = self.token_constraints(req)
        try:
            return to_sampling_params(req, max_tokens, logprobs, prompt_logprobs, structured, **constraints)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def token_constraints(self, req: SamplingFields) -> dict[str, Any]:
        """logit_bias, allowed_token_ids and bad_words as SamplingParams fields (token ids in the vocabulary;
        a bad word is banned as written and with a leading space, as vLLM does)."""
        out: dict[str, Any] = {}
        if req.logit_bias:
            try:
                out["logit_bias"] = tuple((int(t), float(b)) for t, b in req.logit_bias.items())
            except ValueError as e:
                raise APIError(400, f"logit_bias keys must be token ids: {e}", param="logit_bias") from e
            self._check_vocab([t for t, _ in out["logit_bias"]], "logit_bias")
        if req.allowed_token_ids is not None:
            self._check_vocab(req.allowed_token_ids, "allowed_token_ids")
            out["allowed_token_ids"] = tuple(req.allowed_token_ids)
        if req.bad_words:
            words: list[tuple[int, ...]] = []
            for word in req.bad_words:
                plain = tuple(self.encode(word.lstrip(), add_special_tokens=False))
                spaced = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
                words += [w for w in dict.fromkeys((plain, spaced)) if w]
            out["bad_words_token_ids"] = tuple(words)
        return out

    def _check_vocab(self, ids: list[int], param: str) -> None:
        vocab = self.served.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def to_sampling_params(
    req: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
    structured: StructuredSpec | None = None, **constraints: Any,
) -> SamplingParams:
    """The OpenAI fields (None = OpenAI's default) as SamplingParams; ValueError on invalid values.
    ``structured``: the output's grammar (``structured.py``); ``constraints``: the token-constraint fields
    (``RequestValidator.token_constraints``)."""
    stop = () if req.stop is None else ((req.stop,) if isinstance(req.stop, str) else tuple(req.stop))
    return SamplingParams(
        n=req.n,
        best_of=req.best_of,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        use_beam_search=req.use_beam_search,
        length_penalty=req.length_penalty,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
        **constraints,
    )


def template_message(m: ChatMessage) -> dict[str, Any]:
    """One message as the chat template gets it: role and text, an assistant's ``tool_calls`` (arguments
    as objects, as templates print them), a tool message's ``tool_call_id`` and ``name``."""
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    extra = m.model_extra or {}
    if extra.get("tool_calls"):
        d["tool_calls"] = [_template_call(c) for c in extra["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if extra.get(key) is not None:
            d[key] = extra[key]
    return d


def _template_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "an assistant tool call needs function.name", param="messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise APIError(400, f"tool call {fn['name']!r}: arguments are not JSON: {e}", param="messages") from e
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    if prompt_logprobs is not None and stream:  # as vLLM: they would need a place in the chunks
        raise APIError(400, "prompt_logprobs are not available with stream=true", param="prompt_logprobs")
