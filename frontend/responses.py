"""OpenAI completion / chat completion bodies and stream chunks, built from the output processor's results
(final ``CompletionOutput``s for a whole answer, ``SeqDelta``s for a stream) as protocol models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from cbserve.scheduler.outputs import TokenLogprob

from .output import CompletionOutput, SeqDelta
from .protocol import (
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
    TopLogprob,
    UsageInfo,
    now,
)
from .structured import ToolMode
from .tool_calls import ToolCallStream, final_message, finish_reason_with_calls

Choices = Sequence[tuple[int, CompletionOutput]]  # (choice index, output)


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
        self.created = now()
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


class CompletionFormatter(_Base):
    """``echo``: per prompt, the text that precedes its choices' outputs ("" without echo)."""

    def __init__(
        self, req_id: str, model: str, tokenizer: Any, n: int, echo: list[str], logprobs: int | None
    ) -> None:
        super().__init__(req_id, model, tokenizer)
        self.n = n
        self.echo = echo
        self.want_logprobs = logprobs is not None
        self.offsets = [len(echo[i // n]) for i in range(n * len(echo))]  # streamed text offsets

    def _envelope(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
        return CompletionResponse(id=self.req_id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _logprobs(
        self, token_ids: list[int], entries: Sequence[TokenLogprob] | None, offset: int
    ) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        lp = CompletionLogprobs()
        for tok, entry in zip(token_ids, entries or [None] * len(token_ids), strict=False):
            text = self.token_text(tok)
            lp.tokens.append(text)
            lp.token_logprobs.append(None if entry is None else entry.logprob)
            lp.top_logprobs.append(None if entry is None else self._top(entry))
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top = {self.token_text(t): lp for t, lp in entry.top}
        top.setdefault(self.token_text(entry.token_id), entry.logprob)
        return top

    def response(self, choices: Choices, usage: UsageInfo) -> CompletionResponse:
        body = []
        for index, out in sorted(choices, key=lambda c: c[0]):
            echo = self.echo[index // self.n]
            lp = self._logprobs(out.token_ids, out.logprobs, len(echo))
            choice = CompletionChoice(index=index, text=echo + out.text, logprobs=lp, finish_reason=out.finish_reason)
            body.append(choice)
        return self._envelope(body, usage)

    def start_chunks(self) -> list[CompletionResponse]:
        echoes = [self.echo[i // self.n] for i in range(len(self.offsets))]
        return [self._chunk(i, text, None, None) for i, text in enumerate(echoes) if text]

    def chunks(self, deltas: list[SeqDelta]) -> list[CompletionResponse]:
        out = []
        for d in deltas:
            lp = self._logprobs(d.token_ids, d.logprobs, self.offsets[d.index])
            if lp is not None:
                self.offsets[d.index] += sum(len(t) for t in lp.tokens)
            out.append(self._chunk(d.index, d.text, lp, d.finish_reason))
        return out

    def _chunk(self, index: int, text: str, lp: CompletionLogprobs | None, finish: str | None) -> CompletionResponse:
        return self._envelope([CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish)], None)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._envelope([], usage)


class ChatFormatter(_Base):
    """``tools``: how tool calls are read from each choice's text (None: the text is the content)."""

    def __init__(
        self, req_id: str, model: str, tokenizer: Any, n: int, logprobs: bool, tools: ToolMode | None = None
    ) -> None:
        super().__init__(req_id, model, tokenizer)
        self.n = n
        self.want_logprobs = logprobs
        self.tools = tools
        self._streams: dict[int, ToolCallStream] = {}

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
        if self.tools is None:
            return ChatResponseMessage(role="assistant", content=out.text), out.finish_reason
        content, calls = final_message(self.tools, out.text)
        message = ChatResponseMessage(role="assistant", content=content, tool_calls=calls or None)
        return message, finish_reason_with_calls(out.finish_reason, bool(calls))

    def response(self, choices: Choices, usage: UsageInfo) -> ChatCompletionResponse:
        body = []
        for index, out in sorted(choices, key=lambda c: c[0]):
            message, finish = self._message(out)
            body.append(ChatChoice(index=index, message=message, logprobs=self._logprobs(out.logprobs),
                                   finish_reason=finish))  # fmt: skip
        return ChatCompletionResponse(id=self.req_id, created=self.created, model=self.model, choices=body, usage=usage)

    def start_chunks(self) -> list[ChatCompletionChunk]:
        return [self._chunk(i, DeltaMessage(role="assistant", content=""), None, None) for i in range(self.n)]

    def chunks(self, deltas: list[SeqDelta]) -> list[ChatCompletionChunk]:
        if self.tools is not None:
            return [self._tool_chunk(d) for d in deltas]
        return [
            self._chunk(d.index, DeltaMessage(content=d.text), self._logprobs(d.logprobs), d.finish_reason)
            for d in deltas
        ]

    def _tool_chunk(self, d: SeqDelta) -> ChatCompletionChunk:
        """A delta of a choice whose text may hold tool calls: content and tool-call pieces as they parse."""
        stream = self._streams.get(d.index)
        if stream is None:
            stream = self._streams[d.index] = ToolCallStream(self.tools)  # type: ignore[arg-type]
        content, calls = stream.feed(d.text, final=d.finish_reason is not None)
        delta = DeltaMessage(content=content, tool_calls=calls or None)
        finish = finish_reason_with_calls(d.finish_reason, stream.has_calls)
        return self._chunk(d.index, delta, self._logprobs(d.logprobs), finish)

    def _chunk(
        self, index: int, delta: DeltaMessage, lp: ChatLogprobs | None, finish: str | None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)
        return ChatCompletionChunk(id=self.req_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.req_id, created=self.created, model=self.model, choices=[], usage=usage)
