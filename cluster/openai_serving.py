"""The OpenAI-compatible request logic behind the ingress: validate, tokenize, run one engine request per
prompt, detokenize incrementally (stop strings end a sequence: the engine is told to finish it) and shape
the results as completions / chat completions, streamed (SSE) or not."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cbserve.cluster.config import CBServeConfig
from cbserve.cluster.engine_client import EngineClient
from cbserve.cluster.openai_format import ChatFormatter, CompletionFormatter, Formatter, merge_streams
from cbserve.cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    UsageInfo,
    new_id,
)
from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.request import EngineRequest, RequestOutput
from cbserve.scheduler.sampling_params import SamplingParams
from cbserve.worker.tokenizer import IncrementalDetokenizer, apply_chat_template
from pydantic import ValidationError


@dataclass
class SeqDelta:
    """What one engine output adds to one choice."""

    index: int  # choice index (prompt_index * n + sequence index)
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None


@dataclass
class _SeqState:
    detok: IncrementalDetokenizer
    finished: bool = False
    num_tokens: int = 0


@dataclass
class Generation:
    """One engine request (one prompt, n sequences) in flight."""

    req_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: AsyncIterator[list[RequestOutput]]
    seqs: list[_SeqState] = field(default_factory=list)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class OpenAIServing:
    def __init__(
        self, config: CBServeConfig, tokenizer: Any, client: EngineClient, eos_token_ids: list[int],
        vocab_size: int | None = None,
    ) -> None:
        """``eos_token_ids``: the EOS first, then other ids that also end a sequence (unless ignore_eos)."""
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos = tuple(eos_token_ids[1:])
        self.vocab_size = vocab_size or len(tokenizer)

    # ---- validation ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    @staticmethod
    def parse(model_cls: type, body: bytes) -> Any:
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from e
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            raise APIError(400, f"{loc}: {err.get('msg')}", param=loc or None) from e

    def _params(
        self, req: Any, num_prompt: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        max_len = self.config.max_model_len
        if num_prompt == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if num_prompt >= max_len or (max_tokens is not None and num_prompt + max_tokens > max_len):
            asked = num_prompt + (max_tokens or 0)
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested {asked} "
                f"tokens ({num_prompt} in the prompt, {max_tokens or 0} for the completion).",
                param="max_tokens" if num_prompt < max_len else "prompt",
            )
        if max(req.n, req.best_of or 0) > self.config.max_n:
            raise APIError(400, f"n (and best_of) must be <= {self.config.max_n}", param="n")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError(400, "best_of > n cannot be streamed", param="best_of")
        if max_tokens is None:
            max_tokens = max_len - num_prompt
        try:
            sp = req.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        extra = tuple(t for t in self.extra_eos if t not in sp.stop_token_ids)
        if extra and not sp.ignore_eos:  # models with several EOS ids: the others stop too (as LLM does)
            sp = dataclasses.replace(sp, stop_token_ids=sp.stop_token_ids + extra)
        return sp

    # ---- prompts ------------------------------------------------------------------------------
    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [self._checked_ids(prompt)]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return [self.encode(p) if isinstance(p, str) else self._checked_ids(p) for p in prompt]

    def _checked_ids(self, ids: list[int]) -> list[int]:
        """Token-id prompts must name tokens of the vocabulary (an out-of-range id would crash the forward)."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in the prompt is outside the vocabulary [0, {self.vocab_size})",
                           param="prompt")
        return list(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"]) if text else []

    def chat_prompt(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in messages]
            return apply_chat_template(self.tokenizer, msgs, add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    # ---- endpoints ----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(400, "logprobs must be >= 0", param="logprobs")
        prompts = self.completion_prompts(req.prompt)
        params = [self._params(req, len(p), req.max_tokens, req.logprobs) for p in prompts]
        req_id = new_id("cmpl")
        echo = [self.tokenizer.decode(p) if req.echo else "" for p in prompts]
        fmt = CompletionFormatter(req_id, self.config.model_name, self.tokenizer, req.n, echo, req.logprobs)
        return await self._run(req_id, prompts, params, req.stream, req.include_usage, fmt)

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt = self.chat_prompt(req.messages, req.add_generation_prompt)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, len(prompt), max_tokens, logprobs)
        req_id = new_id("chatcmpl")
        fmt = ChatFormatter(req_id, self.config.model_name, self.tokenizer, req.n, logprobs is not None)
        return await self._run(req_id, [prompt], [params], req.stream, req.include_usage, fmt)

    async def _run(
        self, req_id: str, prompts: list[list[int]], params: list[SamplingParams], stream: bool,
        include_usage: bool, fmt: Formatter,
    ) -> dict[str, Any] | AsyncIterator[str]:
        gens: list[Generation] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = req_id if len(prompts) == 1 else f"{req_id}-{i}"
                gens.append(await self._start(rid, i, prompt, sp))
        except BaseException:
            for g in gens:
                await g.stream.aclose()  # type: ignore[attr-defined]
            raise
        if stream:
            return self._sse(gens, fmt, include_usage)
        async for deltas in merge_streams([self._deltas(g) for g in gens]):
            fmt.add(deltas)
        return fmt.response(self._usage(gens))

    async def _sse(self, gens: list[Generation], fmt: Formatter, include_usage: bool) -> AsyncIterator[str]:
        try:
            for chunk in fmt.start_chunks():
                yield _sse(chunk)
            async for deltas in merge_streams([self._deltas(g) for g in gens]):
                for chunk in fmt.chunks(deltas):
                    yield _sse(chunk)
            if include_usage:
                yield _sse(fmt.usage_chunk(self._usage(gens)))
        except APIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    @staticmethod
    def _usage(gens: list[Generation]) -> UsageInfo:
        prompt = sum(len(g.prompt_token_ids) for g in gens)
        completion = sum(g.num_completion_tokens for g in gens)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    # ---- one engine request -------------------------------------------------------------------
    async def _start(
        self, req_id: str, prompt_index: int, prompt: list[int], sp: SamplingParams
    ) -> Generation:
        """Send the request and wait until the engine admitted it (errors surface here, before any
        response is committed)."""
        request = EngineRequest(req_id, prompt, sp, eos_token_id=self.eos_token_id)
        stream = self.client.generate(request)
        await stream.__anext__()  # admission: raises APIError (400 / 429 / 503)
        seqs = [
            _SeqState(
                IncrementalDetokenizer(
                    self.tokenizer, prompt, sp.skip_special_tokens, sp.stop, sp.include_stop_str_in_output
                )
            )
            for _ in range(sp.n)
        ]
        return Generation(req_id, prompt_index, prompt, sp, stream, seqs)

    async def _deltas(self, gen: Generation) -> AsyncIterator[list[SeqDelta]]:
        """The generation's outputs as per-choice deltas; ends when every sequence finished."""
        try:
            async for outputs in gen.stream:
                deltas = [d for out in outputs if (d := self._apply(gen, out)) is not None]
                if deltas:
                    yield deltas
                if all(s.finished for s in gen.seqs):
                    return
        finally:
            await gen.stream.aclose()  # type: ignore[attr-defined]

    def _apply(self, gen: Generation, out: RequestOutput) -> SeqDelta | None:
        if out.index >= len(gen.seqs):
            return None
        seq = gen.seqs[out.index]
        if seq.finished:
            return None
        tokens = out.new_token_ids
        upd = seq.detok.add_tokens(tokens)
        seq.num_tokens += len(tokens)
        text, finish = upd.new_text, None
        if upd.stopped:
            finish = "stop"
            if not out.finished:
                self.client.finish(gen.req_id, out.index)
        elif out.finished:
            text += seq.detok.flush()
            finish = "stop" if seq.detok.stopped else out.finish_reason
        if finish is not None:
            seq.finished = True
        index = gen.prompt_index * gen.params.n + out.index
        return SeqDelta(index, text, list(tokens), out.new_logprobs, finish)


def _sse(obj: Any) -> str:
    data = obj if isinstance(obj, dict) else obj.model_dump(exclude_none=False)
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
