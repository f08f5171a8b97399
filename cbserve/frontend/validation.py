"""Request validation and prompt building for the OpenAI server: the body parsed into its protocol model,
the model name checked, prompts turned into token ids (text, token ids within the vocabulary, chat
messages through the chat template), lengths checked (``scheduler.limits``, the engine's own rule) and the
request's SamplingParams built. Every problem is an APIError naming the field (HTTP 400, 404 for a model)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from cbserve.frontend.field_policy import FieldPolicy
from cbserve.frontend.lora_registry import LoRARegistry
from cbserve.frontend.protocol import APIError, ChatCompletionRequest, ChatMessage, SamplingFields
from cbserve.frontend.tokenizer import apply_chat_template
from cbserve.scheduler.errors import RequestRejectedError
from cbserve.scheduler.requests.kv_transfer import KVTransferParams
from cbserve.scheduler.requests.limits import resolve_max_tokens
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.retention import Retention
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


class RequestValidator:
    """``loras``: the adapters a request's ``model`` may name besides the served model (none by default)."""

    def __init__(self, served: ServedModel, tokenizer: Any, loras: LoRARegistry | None = None) -> None:
        self.served = served
        self.tokenizer = tokenizer
        self.fields = FieldPolicy()
        self.loras = loras if loras is not None else LoRARegistry(served.name)

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
        ids = self._render(req.messages, req.add_generation_prompt, req.add_special_tokens, kwargs)
        return self.truncated(ids, req.truncate_prompt_tokens)

    def _render(self, messages: list[ChatMessage], add_generation_prompt: bool, add_special_tokens: bool,
                kwargs: dict[str, Any]) -> list[int]:
        msgs = [template_message(m) for m in messages]  # a malformed tool call: a 400 of its own
        try:
            return apply_chat_template(self.tokenizer, msgs, add_generation_prompt, add_special_tokens, **kwargs)
        except Exception as e:  # the template's own errors (jinja, a missing variable, a bad message)
            raise APIError(400, f"the chat template failed: {e}", param="messages") from e

    # ---- retention hints (scheduler/kv/retention.py) -------------------------------------------
    def retention(self, req: SamplingFields, prompt_len: int, marks: Sequence[tuple[int, float]] = ()
                  ) -> tuple[Retention, ...]:
        """The ranges of a prompt its request asks to keep cached: ``retention_directives``, the chat messages'
        ``cache_control`` (``marks``: where each marked message ends, and its TTL) and ``prompt_cache_retention``
        ("24h": the whole prompt, for 24 hours or the server's longest, whichever is shorter). The engine checks
        them against the prompt and the server's limits (a 400 naming what is wrong)."""
        prio, longest = self.served.retention_priority, self.served.retention_max_s
        out = [Retention(d.start, prompt_len if d.end is None else d.end, d.priority,
                         d.duration or min(DEFAULT_RETAIN_S, longest)) for d in req.retention_directives or ()]
        out += [Retention(0, end, prio, min(ttl, longest)) for end, ttl in marks]  # "up to" the TTL asked
        keep = req.prompt_cache_retention
        if keep == "24h":
            out.append(Retention(0, prompt_len, prio, min(86400.0, longest)))
        elif keep not in (None, "in_memory", "in-memory"):
            raise APIError(400, f"prompt_cache_retention must be 'in_memory' or '24h', got {keep!r}",
                           param="prompt_cache_retention")
        return tuple(out)

    def cache_control_marks(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                            prompt: list[int]) -> list[tuple[int, float]]:
        """The prefix ``cache_control`` marks (on a message or one of its content parts) ask to keep: the
        conversation up to the last marked message, rendered as the template renders it, for the longest TTL asked
        (a range keeps every block before its end: the earlier marks' prefixes come with it). One render; a template
        that cannot render that part of the conversation alone keeps nothing (the request runs all the same)."""
        marks = [(i, ttl) for i, m in enumerate(req.messages) if (ttl := cache_control_ttl(m)) is not None]
        if not marks:
            return []
        if req.truncate_prompt_tokens is not None:
            raise APIError(400, "cache_control does not combine with truncate_prompt_tokens", param="messages")
        kwargs = dict(req.chat_template_kwargs or {})
        kwargs |= {"chat_template": req.chat_template} if req.chat_template is not None else {}
        kwargs |= {"tools": tools} if tools is not None else {}
        try:
            upto = self._render(req.messages[: marks[-1][0] + 1], False, req.add_special_tokens, kwargs)
        except APIError:
            return []
        end = _common_prefix(upto, prompt)  # (a template that renders a conversation's start otherwise: what is shared)
        return [(end, max(ttl for _, ttl in marks))] if end else []

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


DEFAULT_RETAIN_S = 300.0  # a retention directive without a duration: a prompt cache's usual five minutes
CACHE_CONTROL_TTL = {"5m": 300.0, "1h": 3600.0}  # Anthropic's ephemeral cache_control TTLs


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def cache_control_ttl(m: ChatMessage) -> float | None:
    """The TTL a message's ``cache_control`` asks (on the message, or on one of its content parts), else None."""
    marks = [(m.model_extra or {}).get("cache_control")]
    if isinstance(m.content, list):
        marks += [p.get("cache_control") for p in m.content if isinstance(p, dict)]
    ttl = None
    for mark in marks:
        if mark is None:
            continue
        if not isinstance(mark, dict) or mark.get("type") != "ephemeral" or \
                mark.get("ttl", "5m") not in CACHE_CONTROL_TTL or set(mark) - {"type", "ttl"}:
            raise APIError(400, f"cache_control must be {{'type': 'ephemeral'}} with an optional ttl of "
                           f"{sorted(CACHE_CONTROL_TTL)}, got {mark!r}", param="messages")
        ttl = max(ttl or 0.0, CACHE_CONTROL_TTL[mark.get("ttl", "5m")])
    return ttl
