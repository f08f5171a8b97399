"""The one output processor of the front end, shared by the offline ``LLM`` and the OpenAI server.

``OutputProcessor.add_request`` turns a prompt and its SamplingParams into the EngineRequest (the model's
EOS id, and its other EOS ids as stop tokens) and keeps the request's state: one detokenizer per sequence.
``process`` applies each RequestOutput the engine streams back: the new text (complete characters only,
held back while it may still start a stop string), the sequence's tokens, logprobs and finish reason. A stop
string ends the sequence here and the engine is told to finish it (``finish_sequence``). Each call returns
the per-choice delta a stream sends; the assembled ``CompletionOutput``s make the final answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cbserve.frontend.text.detokenizer import IncrementalDetokenizer
from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.requests.kv_transfer import KVTransferParams
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput
from cbserve.scheduler.requests.retention import Retention
from cbserve.scheduler.requests.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One generated sequence of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | None = None  # the stop string that ended it, if any
    error: str | None = None  # finish reason "error": what failed (the request alone; scheduler/fault_isolation.py)
    weights_version: int = 0  # the version of the weights that produced its last token (an RL loop's update_weights)


@dataclass
class GenerateOutput:
    """All sequences generated for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # With ``prompt_logprobs``: one entry per prompt token, the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    kv_transfer_params: dict | None = None  # a prefill engine's answer (scheduler/requests/kv_transfer.py)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class SeqDelta:
    """What one engine output adds to one choice."""

    index: int  # choice index: the request's choice_offset + the sequence index
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the request's, once the engine sent them


@dataclass
class _Seq:
    out: CompletionOutput
    detok: IncrementalDetokenizer


class RequestState:
    """One engine request (one prompt, ``n`` sequences) as the front end sees it."""

    def __init__(
        self, processor: OutputProcessor, result: GenerateOutput, params: SamplingParams, choice_offset: int,
        request: EngineRequest,
    ) -> None:
        self.result = result
        self.params = params
        self.choice_offset = choice_offset
        self.request = request  # what the engine gets
        self._processor = processor
        self.seqs = [processor.new_seq(i, result.prompt_token_ids, params) for i in range(params.n)]
        result.outputs = [s.out for s in self.seqs]
        # Served (cluster/ingress/engine_client.py): the items its engine replica sends back, that replica, and what the
        # request costs there (its tokens, for the router's load; its prefill still queued there).
        self.queue: asyncio.Queue[Any] | None = None
        self.replica: int | None = None
        self.cost = self.prefill = 0

    def streamed(self) -> tuple[list[int], float | None]:
        """Sequence 0's tokens so far and their cumulative logprob (what a continuation on another replica goes on
        from: cluster/ingress/continuation.py)."""
        out = self.seqs[0].out
        return out.token_ids, out.cumulative_logprob

    @property
    def req_id(self) -> str:
        return self.result.request_id

    @property
    def finished(self) -> bool:
        return self.result.finished

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.result.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.out.token_ids) for s in self.seqs)

    def choices(self) -> list[tuple[int, CompletionOutput, list[TokenLogprob | None] | None]]:
        """(choice index, output, the prompt's logprobs) of every sequence."""
        return [(self.choice_offset + s.out.index, s.out, self.result.prompt_logprobs) for s in self.seqs]

    def process(self, o: RequestOutput) -> SeqDelta | None:
        """Apply one engine output; None when it changes nothing (an ended sequence, an unknown index)."""
        if o.prompt_logprobs is not None and self.result.prompt_logprobs is None:
            self.result.prompt_logprobs = list(o.prompt_logprobs)
        if o.kv_transfer_params is not None:
            self.result.kv_transfer_params = o.kv_transfer_params
        if not 0 <= o.index < len(self.seqs) or self.seqs[o.index].out.finish_reason is not None:
            return None
        if o.final_token_ids is not None:  # best_of / beam search: the whole output at once
            self.seqs[o.index] = self._processor.new_seq(o.index, self.result.prompt_token_ids, self.params)
            self.result.outputs[o.index] = self.seqs[o.index].out
        seq = self.seqs[o.index]
        out, detok = seq.out, seq.detok
        out.token_ids.extend(o.new_token_ids)
        out.weights_version = o.weights_version
        if out.logprobs is not None and o.new_logprobs is not None:
            out.logprobs.extend(o.new_logprobs)
        if o.cumulative_logprob is not None:
            out.cumulative_logprob = o.cumulative_logprob
        update = detok.add_tokens(o.new_token_ids)
        text, finish = update.new_text, None
        if update.stopped:
            finish = "stop"
            if not o.finished:  # the engine would go on generating: end the sequence there too
                self._processor.finish_sequence(self.req_id, o.index)
        elif o.finished:
            text += detok.flush()
            finish = "stop" if detok.stopped else o.finish_reason
        out.text += text
        if finish is not None:
            out.finish_reason, out.stop_reason = finish, detok.stop_reason
            out.error = None if o.error is None else o.error.message
            self.result.num_cached_tokens = max(self.result.num_cached_tokens, o.num_cached_tokens)
        index = self.choice_offset + o.index
        return SeqDelta(index, text, list(o.new_token_ids), o.new_logprobs, finish, self.result.prompt_logprobs)


class OutputProcessor:
    """Builds engine requests and applies the engine's outputs to them (see the module docstring).

    ``eos_token_ids``: every id that ends a sequence (the model's files); the tokenizer's EOS goes first and
    is the request's ``eos_token_id``, the others are added to ``stop_token_ids`` unless ``ignore_eos``.
    ``finish_sequence(req_id, index)`` tells the engine that a stop string ended a sequence.
    """

    def __init__(
        self, tokenizer: Any, eos_token_ids: Iterable[int], finish_sequence: Callable[[str, int], None],
        requests: dict[str, RequestState] | None = None,
    ) -> None:
        """``requests``: the registry to keep the requests in (served: the one the engine client reads too)."""
        self.tokenizer = tokenizer
        self.finish_sequence = finish_sequence
        ids = list(dict.fromkeys(eos_token_ids))
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids = [tok_eos] + [t for t in ids if t != tok_eos]
        self.eos_token_id: int | None = ids[0] if ids else None
        self.extra_eos_token_ids = tuple(ids[1:])
        self.requests: dict[str, RequestState] = {} if requests is None else requests

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
        choice_offset: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRARequest | None = None,
        retention: tuple[Retention, ...] = (),
        kv_transfer: KVTransferParams | None = None,
    ) -> EngineRequest:
        """Track a new request and return what to send to the engine (``lora``: the adapter it runs with;
        ``retention``: the ranges of its prompt to keep cached)."""
        ids = list(prompt_token_ids)
        request = EngineRequest(req_id, ids, self.engine_params(params), eos_token_id=self.eos_token_id,
                                priority=priority, cache_salt=cache_salt, lora=lora, retention=retention,
                                kv_transfer=kv_transfer)  # fmt: skip
        self.requests[req_id] = RequestState(self, GenerateOutput(req_id, prompt, ids), params, choice_offset, request)
        return request

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """Models with several EOS ids: the others stop a sequence too (unless ``ignore_eos``)."""
        extra = tuple(t for t in self.extra_eos_token_ids if t not in params.stop_token_ids)
        if extra and not params.ignore_eos:
            return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        return params

    def process(self, o: RequestOutput) -> SeqDelta | None:
        state = self.requests.get(o.req_id)
        return None if state is None else state.process(o)

    def pop(self, req_id: str) -> RequestState | None:
        """Forget a request (finished, failed or abandoned)."""
        return self.requests.pop(req_id, None)

    def new_seq(self, index: int, prompt_token_ids: list[int], params: SamplingParams) -> _Seq:
        """The state of one sequence: the only place a detokenizer is built."""
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output, params.min_tokens,
        )
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        return _Seq(CompletionOutput(index, "", [], None, logprobs), detok)
