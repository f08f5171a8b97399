"""Stand-ins for the front-end tests: a character tokenizer (one token per character, id = code point), an
engine that replays scripted outputs, and a request body parsed as the server's edge does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from cbserve.frontend.validation import invalid_body_error
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput

M = TypeVar("M", bound=BaseModel)

EOS = 3  # decodes to nothing with skip_special_tokens


class CharTokenizer:
    eos_token_id = EOS
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool,
                            continue_final_message: bool = False, **kw: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "".join(f"[{k}={v}]" for k, v in kw.items())
        if not continue_final_message:
            text += "</>"
        return text + ("<assistant>" if add_generation_prompt else "")

    def __len__(self) -> int:
        return 0x3000


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def out(req_id: str, text: str, index: int = 0, finished: bool = False, reason: str | None = None,
        **kw: Any) -> RequestOutput:
    return RequestOutput(req_id, index, ids(text), kw.pop("new_logprobs", None), finished,
                         reason if finished else None, **kw)


class ScriptedEngine:
    """``add`` admits the request (``requests`` records it), then its outputs are one batch per scripted step:
    ``script(req)`` returns the batches (or raises: the admission is refused). ``finished`` records (req_id, index)
    of every stop-string finish; ``closed`` the requests whose output stream was closed (the server's engine aborts
    an unfinished one then)."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.requests: list[EngineRequest] = []
        self.finished: list[tuple[str, int]] = []
        self.closed: list[str] = []

    async def add(self, state: Any) -> AsyncIterator[list[RequestOutput]]:
        self.requests.append(state.request)
        try:
            return _Outputs(self, state.request)
        except BaseException:  # a script that raises: the admission is refused, no stream to close
            self.requests.pop()
            raise

    def finish(self, req_id: str, index: int) -> None:
        self.finished.append((req_id, index))


class _Outputs:
    """A request's scripted batches, as an async iterator whose ``aclose`` is recorded even when never started."""

    def __init__(self, engine: ScriptedEngine, request: EngineRequest) -> None:
        self.engine, self.req_id = engine, request.req_id
        self._batches = iter(engine.script(request))
        self._closed = False

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        await asyncio.sleep(0)  # outputs arrive from elsewhere: other tasks run in between
        try:
            return next(self._batches)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.closed.append(self.req_id)


def parse_body(model_cls: type[M], body: bytes) -> M:
    """A JSON request body as ``model_cls``, as the server's FastAPI validates it: malformed JSON or invalid fields
    are the 400 naming the field (``invalid_body_error``, what the HTTP edge answers)."""
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as e:
        raise invalid_body_error(e.errors()) from e
