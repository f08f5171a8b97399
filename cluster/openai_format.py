"""Shaping per-choice deltas into OpenAI completion / chat completion responses and stream chunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from cbserve.cluster.openai_protocol import UsageInfo, now
from cbserve.scheduler.outputs import TokenLogprob

if TYPE_CHECKING:
    from cbserve.cluster.openai_serving import SeqDelta

T = TypeVar("T")


class Formatter(Protocol):
    def add(self, deltas: list[SeqDelta]) -> None: ...
    def response(self, usage: UsageInfo) -> dict[str, Any]: ...
    def start_chunks(self) -> list[dict[str, Any]]: ...
    def chunks(self, deltas: list[SeqDelta]) -> list[dict[str, Any]]: ...
    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]: ...


class _Base:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, req_id: str, model: str, tokenizer: Any, num_choices: int) -> None:
        self.req_id = req_id
        self.model = model
        self.tokenizer = tokenizer
        self.created = now()
        self.texts = [""] * num_choices
        self.finish = [None] * num_choices  # type: list[str | None]
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _envelope(self, obj: str, choices: list[dict[str, Any]], usage: UsageInfo | None) -> dict[str, Any]:
        return {
            "id": self.req_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": None if usage is None else usage.model_dump(),
        }

    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name, [], usage)


class CompletionFormatter(_Base):
    object_name = chunk_object_name = "text_completion"

    def __init__(
        self, req_id: str, model: str, tokenizer: Any, n: int, echo: list[str], logprobs: int | None
    ) -> None:
        super().__init__(req_id, model, tokenizer, n * len(echo))
        self.n = n
        self.echo = echo
        self.want_logprobs = logprobs is not None
        self.texts = [echo[i // n] for i in range(n * len(echo))]
        self.offsets = [len(t) for t in self.texts]
        self.logprobs: list[dict[str, list[Any]]] = [_empty_completion_logprobs() for _ in self.texts]

    def _logprobs(self, d: SeqDelta) -> dict[str, list[Any]] | None:
        if not self.want_logprobs:
            return None
        lp = _empty_completion_logprobs()
        for tok, entry in zip(d.token_ids, d.logprobs or [None] * len(d.token_ids), strict=False):
            text = self.token_text(tok)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(None if entry is None else entry.logprob)
            lp["top_logprobs"].append(None if entry is None else self._top(entry))
            lp["text_offset"].append(self.offsets[d.index])
            self.offsets[d.index] += len(text)
        return lp

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top = {self.token_text(t): lp for t, lp in entry.top}
        top.setdefault(self.token_text(entry.token_id), entry.logprob)
        return top

    def add(self, deltas: list[SeqDelta]) -> None:
        for d in deltas:
            self.texts[d.index] += d.text
            lp = self._logprobs(d)
            if lp is not None:
                for k, v in lp.items():
                    self.logprobs[d.index][k].extend(v)
            self.finish[d.index] = d.finish_reason or self.finish[d.index]

    def response(self, usage: UsageInfo) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "text": text,
                "logprobs": self.logprobs[i] if self.want_logprobs else None,
                "finish_reason": self.finish[i],
            }
            for i, text in enumerate(self.texts)
        ]
        return self._envelope(self.object_name, choices, usage)

    def start_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk(i, text, None, None) for i, text in enumerate(self.texts) if text]

    def chunks(self, deltas: list[SeqDelta]) -> list[dict[str, Any]]:
        return [self._chunk(d.index, d.text, self._logprobs(d), d.finish_reason) for d in deltas]

    def _chunk(self, index: int, text: str, lp: Any, finish: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return self._envelope(self.chunk_object_name, [choice], None)


class ChatFormatter(_Base):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, req_id: str, model: str, tokenizer: Any, n: int, logprobs: bool) -> None:
        super().__init__(req_id, model, tokenizer, n)
        self.want_logprobs = logprobs
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, d: SeqDelta) -> list[dict[str, Any]] | None:
        if not self.want_logprobs:
            return None
        content = []
        for entry in d.logprobs or []:
            item = self._entry(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in entry.top]
            content.append(item)
        return content

    def add(self, deltas: list[SeqDelta]) -> None:
        for d in deltas:
            self.texts[d.index] += d.text
            self.logprobs[d.index].extend(self._logprobs(d) or [])
            self.finish[d.index] = d.finish_reason or self.finish[d.index]

    def response(self, usage: UsageInfo) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": {"content": self.logprobs[i]} if self.want_logprobs else None,
                "finish_reason": self.finish[i],
            }
            for i, text in enumerate(self.texts)
        ]
        return self._envelope(self.object_name, choices, usage)

    def start_chunks(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk(i, dict(role), None, None) for i in range(len(self.texts))]

    def chunks(self, deltas: list[SeqDelta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            lp = self._logprobs(d)
            lp_obj = None if lp is None else {"content": lp}
            out.append(self._chunk(d.index, {"content": d.text}, lp_obj, d.finish_reason))
        return out

    def _chunk(self, index: int, delta: dict[str, Any], lp: Any, finish: str | None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return self._envelope(self.chunk_object_name, [choice], None)


def _empty_completion_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators as they come (one iterator: passed through unchanged)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
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
