"""Stand-ins for the front-end tests: a character tokenizer (one token per character, id = code point) and an
engine that replays scripted outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cbserve.scheduler.request import EngineRequest, RequestOutput

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
    """``generate`` yields [] (admitted) then one batch per scripted step for that request: ``script(req)``
    returns the batches. ``finished`` records (req_id, index) of every stop-string finish."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.requests: list[EngineRequest] = []
        self.finished: list[tuple[str, int]] = []
        self.closed: list[str] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[RequestOutput]]:
        self.requests.append(request)
        try:
            yield []
            for batch in self.script(request):
                await asyncio.sleep(0)  # outputs arrive from elsewhere: other tasks run in between
                yield batch
        finally:
            self.closed.append(request.req_id)

    def finish(self, req_id: str, index: int) -> None:
        self.finished.append((req_id, index))
