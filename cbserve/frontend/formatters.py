"""OpenAI completion / chat completion bodies and stream chunks, built from the output processor's results
(final ``CompletionOutput``s for a whole answer, ``SeqDelta``s for a stream) as protocol models."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from cbserve.frontend.output import CompletionOutput, SeqDelta
from cbserve.frontend.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    UsageInfo,
)
from cbserve.frontend.tools.calls import ToolCallStream, final_message, finish_reason_with_calls
from cbserve.frontend.tools.reasoning import ReasoningMode, ReasoningStream, split_reasoning
from cbserve.frontend.tools.structured import ToolMode
from cbserve.scheduler.outputs import TokenLogprob

Choices = Sequence[tuple[int, CompletionOutput, list[TokenLogprob | None] | None]]  # (index, output, prompt lps)


class Formatter(Protocol):
    def response(self, choices: Choices, usage: UsageInfo) -> Any: ...
    def start_chunks(self) -> list[Any]: ...
    def chunks(self, deltas: list[SeqDelta]) -> list[Any]: ...
    def usage_chunk(self, usage: UsageInfo) -> Any: ...


class _Base:
    def __init__(self, req_id: str, model: str, tokenizer: Any) -> None:
        self.req_id = req_id
        self.model = model
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.want_prompt_logprobs = False

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def vllm_prompt_logprobs(self, prompt_lps: list[TokenLogprob | None] | None) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs``: per prompt token (the first None), {token id: logprob, rank, text}
        for the top alternatives and the prompt token itself."""
        if not self.want_prompt_logprobs or prompt_lps is None:
            return None
        out: PromptLogprobs = []
        for e in prompt_lps:
            if e is None:
                out.append(None)
                continue
            d = {t: PromptLogprob(logprob=v, rank=r, decoded_token=self.token_text(t)) for r, (t, v) in
                 enumerate(e.top, 1)}
            d[e.token_id] = PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=self.token_text(e.token_id))
            out.append(d)
        return out


class CompletionFormatter(_Base):
    """``prompts``: the token ids of each prompt. ``echo``: each choice's text starts with its prompt's text,
    and with ``logprobs`` its logprobs start with the prompt tokens' (the first None, as OpenAI gives them);
    ``echo_only`` (``max_tokens=0``): the prompt is all there is. ``prompt_logprobs``: vLLM's field, per
    choice."""

    def __init__(
        self, req_id: str, model: str, tokenizer: Any, n: int, prompts: list[list[int]], echo: bool,
        logprobs: int | None, echo_only: bool = False, prompt_logprobs: bool = False, token_ids: bool = False,
    ) -> None:
        super().__init__(req_id, model, tokenizer)
        self.token_ids = token_ids  # ``return_token_ids``: each choice's prompt and generated token ids
        self.n = n
        self.prompts = prompts
        self.echo = [tokenizer.decode(p) if echo else "" for p in prompts]
        self.logprobs = logprobs
        self.echo_logprobs = echo and logprobs is not None  # the prompt's logprobs come with its first delta
        self.echo_only = echo_only
        self.want_prompt_logprobs = prompt_logprobs
        n_choices = n * len(prompts)
        self.offsets = [0 if self.echo_logprobs else len(self.echo[i // n]) for i in range(n_choices)]
        self.started = [not self.echo_logprobs] * n_choices  # the echo went out (or goes with no logprobs)

    def _envelope(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
        return CompletionResponse(id=self.req_id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _logprobs(
        self, token_ids: list[int], entries: Sequence[TokenLogprob | None] | None, offset: int,
        lp: CompletionLogprobs | None = None,
    ) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        lp = lp if lp is not None else CompletionLogprobs()
        for tok, entry in zip(token_ids, entries or [None] * len(token_ids), strict=False):
            text = self.token_text(tok)
            lp.tokens.append(text)
            lp.token_logprobs.append(None if entry is None else entry.logprob)
            lp.top_logprobs.append(None if entry is None else self._top(entry))
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top = {self.token_text(t): lp for t, lp in entry.top[: self.logprobs]}
        top.setdefault(self.token_text(entry.token_id), entry.logprob)
        return top

    def _prompt_part(self, index: int, prompt_lps: list[TokenLogprob | None] | None) -> CompletionLogprobs | None:
        """The prompt tokens' logprobs that start an echoed choice's logprobs."""
        if not self.echo_logprobs:
            return None
        prompt = self.prompts[index // self.n]
        return self._logprobs(prompt, prompt_lps or [None] * len(prompt), 0)

    def response(self, choices: Choices, usage: UsageInfo) -> CompletionResponse:
        body = []
        for index, out, prompt_lps in sorted(choices, key=lambda c: c[0]):
            echo = self.echo[index // self.n]
            gen_ids, gen_lps, text = (([], [], "") if self.echo_only else (out.token_ids, out.logprobs, out.text))
            lp = self._prompt_part(index, prompt_lps)
            lp = self._logprobs(gen_ids, gen_lps, len(echo), lp)
            finish = "length" if self.echo_only else out.finish_reason
            choice = CompletionChoice(index=index, text=echo + text, logprobs=lp, finish_reason=finish,
                                      prompt_logprobs=self.vllm_prompt_logprobs(prompt_lps))
            if self.token_ids:
                choice.prompt_token_ids, choice.token_ids = self.prompts[index // self.n], list(gen_ids)
            body.append(choice)
        return self._envelope(body, self._usage(usage))

    def _usage(self, usage: UsageInfo) -> UsageInfo:
        """``max_tokens=0``: the one token generated behind the scenes is not part of the answer."""
        if not self.echo_only:
            return usage
        return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens)

    def start_chunks(self) -> list[CompletionResponse]:
        if self.echo_logprobs:
            return []
        echoes = [self.echo[i // self.n] for i in range(len(self.offsets))]
        return [self._chunk(i, text, None, None) for i, text in enumerate(echoes) if text]

    def chunks(self, deltas: list[SeqDelta]) -> list[CompletionResponse]:
        out = []
        for d in deltas:
            text, ids, lps = ("", [], []) if self.echo_only else (d.text, d.token_ids, d.logprobs)
            lp = None
            if not self.started[d.index]:  # echo with logprobs: the prompt goes with the first delta
                self.started[d.index] = True
                text = self.echo[d.index // self.n] + text
                lp = self._prompt_part(d.index, d.prompt_logprobs)
                self.offsets[d.index] = len(self.echo[d.index // self.n])
            lp = self._logprobs(ids, lps, self.offsets[d.index], lp)
            if lp is not None:
                self.offsets[d.index] += sum(len(self.token_text(t)) for t in ids)
            finish = ("length" if d.finish_reason else None) if self.echo_only else d.finish_reason
            if self.echo_only and not text and finish is None:
                continue
            out.append(self._chunk(d.index, text, lp, finish))
        return out

    def _chunk(self, index: int, text: str, lp: CompletionLogprobs | None, finish: str | None) -> CompletionResponse:
        return self._envelope([CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish)], None)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._envelope([], self._usage(usage))


class ChatFormatter(_Base):
    """``tools``: how tool calls are read from each choice's answer (None: the answer is the content);
    ``reasoning``: how each choice's text splits into reasoning and answer (None: all answer)."""

    def __init__(
        self, req_id: str, model: str, tokenizer: Any, n: int, logprobs: bool, prompt_logprobs: bool = False,
        tools: ToolMode | None = None, reasoning: ReasoningMode | None = None,
    ) -> None:
        super().__init__(req_id, model, tokenizer)
        self.n = n
        self.want_logprobs = logprobs
        self.want_prompt_logprobs = prompt_logprobs
        self.tools = tools
        self.reasoning = reasoning
        self._streams: dict[int, ToolCallStream] = {}
        self._thinking: dict[int, ReasoningStream] = {}

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        content = []
        for e in entries or []:
            top = [self._entry(t, lp) for t, lp in e.top]
            content.append(ChatTokenLogprob(**self._entry(e.token_id, e.logprob).model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _message(self, out: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        reasoning, answer = split_reasoning(self.reasoning, out.text) if self.reasoning else (None, out.text)
        if self.tools is None or not answer:
            message = ChatResponseMessage(content=answer, reasoning_content=reasoning, reasoning=reasoning)
            return message, out.finish_reason
        content, calls = final_message(self.tools, answer)
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                      tool_calls=calls or None)  # fmt: skip
        return message, finish_reason_with_calls(out.finish_reason, bool(calls))

    def response(self, choices: Choices, usage: UsageInfo) -> ChatCompletionResponse:
        body = []
        for index, out, _ in sorted(choices, key=lambda c: c[0]):
            message, finish = self._message(out)
            body.append(ChatChoice(index=index, message=message, logprobs=self._logprobs(out.logprobs),
                                   finish_reason=finish))  # fmt: skip
        prompt_lp = self.vllm_prompt_logprobs(choices[0][2]) if choices else None
        return ChatCompletionResponse(
            id=self.req_id, created=self.created, model=self.model, choices=body, usage=usage, prompt_logprobs=prompt_lp
        )

    def start_chunks(self) -> list[ChatCompletionChunk]:
        return [self._chunk(i, DeltaMessage(role="assistant", content=""), None, None) for i in range(self.n)]

    def chunks(self, deltas: list[SeqDelta]) -> list[ChatCompletionChunk]:
        if self.tools is not None or self.reasoning is not None:
            return [self._parsed_chunk(d) for d in deltas]
        return [
            self._chunk(d.index, DeltaMessage(content=d.text), self._logprobs(d.logprobs), d.finish_reason)
            for d in deltas
        ]

    def _parsed_chunk(self, d: SeqDelta) -> ChatCompletionChunk:
        """A delta of a choice whose text may hold reasoning and tool calls: reasoning, content and
        tool-call pieces as they parse (tool calls from the answer only)."""
        final = d.finish_reason is not None
        reasoning, answer = "", d.text
        if self.reasoning is not None:
            thinking = self._thinking.get(d.index)
            if thinking is None:
                thinking = self._thinking[d.index] = ReasoningStream(self.reasoning)
            reasoning, answer = thinking.feed(d.text, final)
        content: str | None = answer or None
        calls: list[Any] = []
        finish = d.finish_reason
        if self.tools is not None:
            stream = self._streams.get(d.index)
            if stream is None:
                stream = self._streams[d.index] = ToolCallStream(self.tools)
            content, calls = stream.feed(answer, final)
            finish = finish_reason_with_calls(d.finish_reason, stream.has_calls)
        delta = DeltaMessage(content=content, reasoning_content=reasoning or None, reasoning=reasoning or None,
                             tool_calls=calls or None)  # fmt: skip
        return self._chunk(d.index, delta, self._logprobs(d.logprobs), finish)

    def _chunk(
        self, index: int, delta: DeltaMessage, lp: ChatLogprobs | None, finish: str | None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)
        return ChatCompletionChunk(id=self.req_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.req_id, created=self.created, model=self.model, choices=[], usage=usage)
