"""The OpenAI request flow behind the ingress: validate and tokenize (``validation.py``), start one engine
request per prompt through the output processor, and answer with a whole completion / chat completion or
an SSE stream of chunks (``responses.py``). The engine is anything with ``generate`` and ``finish``
(``cluster/engine_client.EngineClient`` in the server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from cbserve.frontend.embeddings import Embedder, EmbeddingRequest, EmbeddingResponse, runner_error
from cbserve.frontend.formatters import ChatFormatter, CompletionFormatter, Formatter
from cbserve.frontend.lora_registry import LoRARegistry
from cbserve.frontend.output import OutputProcessor, RequestState, SeqDelta
from cbserve.frontend.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    new_id,
)
from cbserve.frontend.retention_hints import cache_control_marks, retention_hints
from cbserve.frontend.tools.structured import request_spec
from cbserve.frontend.validation import RequestValidator, ServedModel, check_prompt_logprobs
from cbserve.scheduler.requests.kv_transfer import KVTransferParams
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import RequestOutput
from cbserve.scheduler.requests.retention import Retention
from cbserve.scheduler.requests.sampling_params import SamplingParams

T = TypeVar("T")
Answer = BaseModel | AsyncIterator[str]  # a whole response, or the SSE lines of a stream


class Engine(Protocol):
    async def add(self, state: RequestState) -> AsyncIterator[list[RequestOutput]]:
        """Send the request (``state.request``; the state is in the output processor's ``requests``) and return once
        the engine admitted it (APIError otherwise); then its outputs in batches. Closing them early aborts it."""
        ...

    def finish(self, req_id: str, index: int) -> None:
        """A stop string ended sequence ``index``: the engine stops generating it."""
        ...


class OpenAIServing:
    """``loras``: the LoRA adapters a request's ``model`` may name (``lora_registry.py``; none by default)."""

    def __init__(
        self, served: ServedModel, tokenizer: Any, engine: Engine, eos_token_ids: Sequence[int],
        loras: LoRARegistry | None = None, requests: dict[str, RequestState] | None = None,
    ) -> None:
        """``requests``: the registry of requests in flight (served: the engine client's too)."""
        self.served = served
        self.tokenizer = tokenizer
        self.engine = engine
        self.loras = loras if loras is not None else LoRARegistry(served.name)
        self.validator = RequestValidator(served, tokenizer, self.loras, eos_token_ids)
        self.processor = OutputProcessor(tokenizer, eos_token_ids, engine.finish, requests)
        self.grammars = self.validator.grammars  # the grammar checks (compiled against the tokenizer's vocabulary)
        self.embedder = Embedder(self.validator, engine, served.pooling, self.processor)

    # ---- endpoints ----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request_id: str | None = None) -> Answer:
        """``request_id``: the client's id (body ``request_id`` or the X-Request-Id header): the response id
        is ``cmpl-<id>``."""
        self._check_runner("generate", "/v1/completions")
        v = self.validator
        lora = v.check_request(req)
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(400, "logprobs must be >= 0", param="logprobs")
        check_prompt_logprobs(req.prompt_logprobs, req.stream)
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise APIError(400, "max_tokens=0 needs echo=true (the prompt alone)", param="max_tokens")
        if req.return_token_ids and req.stream:
            raise APIError(400, "return_token_ids is not supported with stream", param="return_token_ids")
        spec, param = request_spec(req)
        spec = await v.checked_spec(spec, param, req)
        prompts = [v.truncated(p, req.truncate_prompt_tokens)
                   for p in v.completion_prompts(req.prompt, req.add_special_tokens)]
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the prompt tokens' logprobs start each choice's
            prompt_lp = max(prompt_lp or 0, req.logprobs)
        max_tokens = 1 if echo_only else req.max_tokens
        params = [v.sampling_params(req, len(p), max_tokens, req.logprobs, prompt_lp, spec) for p in prompts]
        hints = [retention_hints(self.served.retention_priority, self.served.retention_max_s, req, len(p))
                 for p in prompts] if _asks_retention(req) else []
        req_id = _response_id("cmpl", request_id or req.request_id)
        fmt = CompletionFormatter(
            req_id, _model_name(self.served, lora), self.tokenizer, req.n, prompts, req.echo, req.logprobs,
            echo_only, req.prompt_logprobs is not None, bool(req.return_token_ids),
        )
        return await self._run(req_id, prompts, params, req, fmt, lora, hints)

    async def chat(self, req: ChatCompletionRequest, request_id: str | None = None) -> Answer:
        self._check_runner("generate", "/v1/chat/completions")
        c = await self.validator.chat(req)
        hints = [retention_hints(self.served.retention_priority, self.served.retention_max_s, req, len(c.prompt),
                                 cache_control_marks(self.validator.render, req, c.tools, c.prompt))] \
            if _asks_retention(req) else []
        req_id = _response_id("chatcmpl", request_id or req.request_id)
        fmt = ChatFormatter(
            req_id, _model_name(self.served, c.lora), self.tokenizer, req.n, c.logprobs is not None,
            req.prompt_logprobs is not None, c.tool_mode, c.reasoning,
        )
        return await self._run(req_id, [c.prompt], [c.params], req, fmt, c.lora, hints)

    async def embeddings(self, req: EmbeddingRequest, request_id: str | None = None) -> EmbeddingResponse:
        """``/v1/embeddings`` (runner "pooling"): one vector per input (``embeddings.py``); the response id is
        ``embd-<id>``."""
        self._check_runner("pooling", "/v1/embeddings")
        return await self.embedder(req, request_id)

    def _check_runner(self, runner: str, endpoint: str) -> None:
        if self.served.runner != runner:
            raise runner_error(self.served.runner, endpoint)

    def models(self) -> ModelList:
        """The served model, then its LoRA adapters (each with the model as its ``parent``)."""
        return ModelList(data=[self.model_card()] + [self._adapter_card(a) for a in self.loras.adapters()])

    def model_card(self, model: str | None = None) -> ModelCard:
        lora = self.validator.check_model(model)
        if lora is not None:
            return self._adapter_card(lora)
        return ModelCard(id=self.served.name, max_model_len=self.served.max_model_len)

    def _adapter_card(self, lora: LoRARequest) -> ModelCard:
        return ModelCard(id=lora.lora_name, max_model_len=self.served.max_model_len, root=lora.lora_path,
                         parent=self.served.name)

    def model_name(self, model: str | None) -> str:
        """The name an answer to a request for ``model`` carries: the adapter's, or the served model's."""
        return _model_name(self.served, self.validator.check_model(model))

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.validator.check_model(req.model)
        if req.messages is not None:
            tokens = self.validator.chat_prompt(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            tokens = list(self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        else:
            raise APIError(400, "give 'prompt' or 'messages'", param="prompt")
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.served.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.validator.check_model(req.model)
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    # ---- one request: n choices per prompt ----------------------------------------------------
    async def _run(
        self, req_id: str, prompts: list[list[int]], params: list[SamplingParams], req: SamplingFields,
        fmt: Formatter, lora: LoRARequest | None = None, hints: Sequence[tuple[Retention, ...]] = (),
    ) -> Answer:
        stream, include_usage = req.stream, bool(req.stream_options and req.stream_options.include_usage)
        gens: list[tuple[RequestState, AsyncIterator[list[RequestOutput]]]] = []
        kv = None if req.kv_transfer_params is None else self.validator.kv_transfer(req, len(prompts))
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = req_id if len(prompts) == 1 else f"{req_id}-{i}"
                keep = hints[i] if hints else ()
                gens.append(await self._start(rid, prompt, sp, i * sp.n, req, lora, keep, kv))
        except BaseException:
            for state, outputs in gens:
                self.processor.pop(state.req_id)
                await outputs.aclose()  # type: ignore[attr-defined]
            raise
        states = [state for state, _ in gens]
        deltas = merge_streams([self._deltas(state, outputs) for state, outputs in gens])
        if stream:
            return self._sse(deltas, states, fmt, include_usage, gens)
        async for _ in deltas:
            pass
        choices = [c for s in states for c in s.choices()]
        response = fmt.response(choices, _usage(states))
        response.weights_version = max((out.weights_version for _, out, _ in choices), default=None)  # an RL loop's
        response.kv_transfer_params = states[0].result.kv_transfer_params  # a prefill engine's answer (disaggregation)
        return response

    async def _start(
        self, req_id: str, prompt: list[int], sp: SamplingParams, choice_offset: int, req: SamplingFields,
        lora: LoRARequest | None = None, retention: tuple[Retention, ...] = (), kv: KVTransferParams | None = None,
    ) -> tuple[RequestState, AsyncIterator[list[RequestOutput]]]:
        """Send the request (with its adapter, if any, its priority, cache salt and retention hints) and wait until
        the engine admitted it (errors surface here, before any response is committed)."""
        if req_id in self.processor.requests:
            raise APIError(400, f"request id {req_id!r} is already in use", param="request_id")
        self.processor.add_request(
            req_id, prompt, sp, choice_offset=choice_offset, priority=req.priority, cache_salt=req.cache_salt,
            lora=lora, retention=retention, kv_transfer=kv,
        )
        state = self.processor.requests[req_id]
        try:
            outputs = await self.engine.add(state)  # admission: raises APIError (400 / 429 / 503)
        except BaseException:
            self.processor.pop(req_id)
            raise
        return state, outputs

    async def _deltas(
        self, state: RequestState, outputs: AsyncIterator[list[RequestOutput]]
    ) -> AsyncIterator[list[SeqDelta]]:
        """The request's outputs as per-choice deltas; ends when every sequence finished."""
        try:
            async for batch in outputs:
                deltas = [d for out in batch if (d := state.process(out)) is not None]
                if deltas:
                    yield deltas
                if state.finished:
                    return
        finally:
            self.processor.pop(state.req_id)
            await outputs.aclose()  # type: ignore[attr-defined]

    async def _release(self, gens: list[tuple[RequestState, AsyncIterator[list[RequestOutput]]]]) -> None:
        """Forget the requests and close their engine streams (aborting them); a no-op for finished ones."""
        for state, outputs in gens:
            self.processor.pop(state.req_id)
            await outputs.aclose()  # type: ignore[attr-defined]

    async def _sse(
        self, deltas: AsyncIterator[list[SeqDelta]], states: list[RequestState], fmt: Formatter,
        include_usage: bool, gens: list[tuple[RequestState, AsyncIterator[list[RequestOutput]]]],
    ) -> AsyncIterator[str]:
        """The SSE lines of a streamed answer. Closed early (the client went away), it closes ``deltas`` at
        once, which releases the engine's stream (aborting the request), rather than when it is collected;
        closed before the first token (``deltas`` never started, so never ran its clean-up), it releases
        ``gens`` itself, after ``deltas`` closed."""
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self._release, gens)
            await stack.enter_async_context(contextlib.aclosing(deltas))  # type: ignore[type-var]
            try:
                for chunk in fmt.start_chunks():
                    yield sse_event(chunk)
                async for batch in deltas:
                    for chunk in fmt.chunks(batch):
                        yield sse_event(_stamp_version(chunk, states))
                if include_usage:
                    yield sse_event(fmt.usage_chunk(_usage(states)))
            except APIError as e:
                yield sse_event(e.body())
            yield "data: [DONE]\n\n"


def _stamp_version(chunk: Any, states: list[RequestState]) -> Any:
    """A chunk that ends a choice names the version of the weights that produced its last token (an RL loop's
    ``weights_version``, as the whole response does unstreamed)."""
    ended = {c.index for c in chunk.choices if c.finish_reason is not None}
    if ended:
        versions = [out.weights_version for s in states for i, out, _ in s.choices() if i in ended]
        chunk.weights_version = max(versions, default=None)
    return chunk


def _asks_retention(req: SamplingFields) -> bool:
    """Whether a request carries retention hints (``retention_directives``, ``prompt_cache_retention``, a chat
    message's ``cache_control``): only then are they resolved (retention_hints.py)."""
    if req.retention_directives or req.prompt_cache_retention:
        return True
    for m in getattr(req, "messages", ()):
        parts = m.content if isinstance(m.content, list) else ()
        if "cache_control" in (m.model_extra or {}) or any(isinstance(p, dict) and "cache_control" in p for p in parts):
            return True
    return False


def _model_name(served: ServedModel, lora: LoRARequest | None) -> str:
    return served.name if lora is None else lora.lora_name


def _response_id(prefix: str, request_id: str | None) -> str:
    return new_id(prefix) if not request_id else f"{prefix}-{request_id}"


def _usage(states: list[RequestState]) -> UsageInfo:
    prompt = sum(s.num_prompt_tokens for s in states)
    completion = sum(s.num_completion_tokens for s in states)
    cached = PromptTokensDetails(cached_tokens=sum(s.result.num_cached_tokens for s in states))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=cached)


def sse_event(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators as they come (one iterator: itself, no layer per item)."""
    return streams[0] if len(streams) == 1 else _merged(streams)


async def _merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((0, item))
            await queue.put((1, None))
        except Exception as e:
            await queue.put((2, e))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            kind, value = await queue.get()
            if kind == 2:
                raise value
            if kind == 1:
                remaining -= 1
            else:
                yield value
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
