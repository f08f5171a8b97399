"""The OpenAI request flow without Ray: validation errors, prompts, whole answers and SSE streams built from
the protocol models, over an engine that replays scripted outputs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from frontend_fakes import EOS, CharTokenizer, ScriptedEngine, out, parse_body

from cbserve.frontend.protocol import APIError, ChatCompletionRequest, CompletionRequest
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.validation import ServedModel
from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.requests.request import EngineRequest

SERVED = ServedModel(name="m", max_model_len=64, max_n=4, vocab_size=0x3000)


def _serving(script: Any) -> tuple[OpenAIServing, ScriptedEngine]:
    engine = ScriptedEngine(script)
    return OpenAIServing(SERVED, CharTokenizer(), engine, [EOS, 5]), engine


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _echo_script(req: EngineRequest) -> list[list[Any]]:
    """Every sequence generates "ok" then finishes by length."""
    n = req.sampling_params.n
    return [[out(req.req_id, "o", index=i) for i in range(n)],
            [out(req.req_id, "k", index=i, finished=True, reason="length") for i in range(n)]]


def test_completion_of_two_prompts_with_n_echo_and_logprobs() -> None:
    def script(req: EngineRequest) -> list[list[Any]]:
        lp = [TokenLogprob(ord("o"), -0.1, 1, [(ord("o"), -0.1), (ord("a"), -2.0)])]
        prompt_lp = [None] + [TokenLogprob(t, -1.5, 2, [(ord("z"), -0.5), (t, -1.5)]) for t in req.prompt_token_ids[1:]]
        return [[out(req.req_id, "o", index=i, new_logprobs=lp, prompt_logprobs=prompt_lp if i == 0 else None)
                 for i in range(2)],
                [out(req.req_id, "k", index=i, finished=True, reason="length", new_logprobs=[
                    TokenLogprob(ord("k"), -0.2, 1, [])]) for i in range(2)]]

    serving, engine = _serving(script)
    req = CompletionRequest(model="m", prompt=["ab", "cde"], n=2, echo=True, logprobs=1, max_tokens=2)
    r = _run(serving.completions(req)).model_dump()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == ["abok", "abok", "cdeok", "cdeok"]
    lp = r["choices"][2]["logprobs"]  # echo: the prompt tokens' logprobs first (the first None)
    assert lp["tokens"] == ["c", "d", "e", "o", "k"] and lp["text_offset"] == [0, 1, 2, 3, 4]
    assert lp["token_logprobs"] == [None, -1.5, -1.5, -0.1, -0.2]
    assert lp["top_logprobs"][:2] == [None, {"z": -0.5, "d": -1.5}]  # top 1 + the prompt token itself
    assert lp["top_logprobs"][3] == {"o": -0.1}
    assert all(q.sampling_params.prompt_logprobs == 1 for q in engine.requests)
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert r["object"] == "text_completion" and r["model"] == "m"
    assert [q.sampling_params.stop_token_ids for q in engine.requests] == [(5,), (5,)]  # the extra EOS id
    assert sorted(engine.closed) == sorted(q.req_id for q in engine.requests) and not serving.processor.requests


def test_streamed_completion_cut_by_a_stop_string_across_tokens() -> None:
    def script(req: EngineRequest) -> list[list[Any]]:
        return [[out(req.req_id, p)] for p in ("Hello E", "N", "D!", "more")]

    serving, engine = _serving(script)
    req = CompletionRequest(prompt="x", stop="END", stream=True, stream_options={"include_usage": True})
    chunks = _lines_of(_run(_run_stream(serving.completions(req))))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "Hello " and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert engine.finished == [(engine.requests[0].req_id, 0)]  # told to stop generating
    assert engine.closed == [engine.requests[0].req_id]  # and the stream released


async def _run_stream(coro: Any) -> Any:
    stream = await coro
    return [line async for line in stream]


def _lines_of(lines: list[str]) -> list[Any]:
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in lines[:-1]]


def test_chat_stream_first_delta_has_the_role_then_content_only() -> None:
    serving, _ = _serving(_echo_script)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, n=2)
    chunks = _lines_of(_run(_run_stream(serving.chat(req))))
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in chunks[2:])
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    for i in (0, 1):
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["index"] == i) == "ok"
    whole = _run(serving.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True)))
    assert whole.choices[0].message.content == "ok" and whole.choices[0].finish_reason == "length"
    assert whole.choices[0].logprobs.content == []  # asked for, none given by this engine


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (b'{"prompt": ', 400, None, "malformed JSON"),
        (b"[1]", 400, None, "JSON object"),
        (b'{"prompt": "hi", "max_tokens": "many"}', 400, "max_tokens", "max_tokens"),
        (b'{"prompt": "hi", "suffix": "x"}', 400, "suffix", "suffix"),
        (b'{"model": "other", "prompt": "hi"}', 404, "model", "does not exist"),
        (b'{"prompt": "' + b"h" * 70 + b'", "max_tokens": 4}', 400, "prompt", "maximum context length is 64"),
        (b'{"prompt": "hi", "max_tokens": 63}', 400, "max_tokens", "maximum context length is 64"),
        (b'{"prompt": ""}', 400, "prompt", "empty"),
        (b'{"prompt": [1, 2, 99999]}', 400, "prompt", "outside the vocabulary"),
        (b'{"prompt": "hi", "n": 5}', 400, "n", "n (and best_of)"),
        (b'{"prompt": "hi", "temperature": -1}', 400, None, "temperature"),
        (b'{"prompt": "hi", "best_of": 2, "stream": true}', 400, "best_of", "cannot be streamed"),
    ],
)
def test_bad_completion_requests_are_openai_errors(body: bytes, status: int, param: str | None, words: str) -> None:
    serving, engine = _serving(_echo_script)
    with pytest.raises(APIError) as info:
        _run(serving.completions(parse_body(CompletionRequest, body)))
    e = info.value
    assert (e.status, e.param) == (status, param) and words in e.message, e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert engine.requests == []  # refused before reaching an engine


def test_an_unset_max_tokens_gets_the_room_left_and_chat_messages_are_checked() -> None:
    serving, engine = _serving(_echo_script)
    _run(serving.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])))
    prompt = engine.requests[0].prompt_token_ids
    assert "".join(map(chr, prompt)) == "<user>hi</><assistant>"
    assert engine.requests[0].sampling_params.max_tokens == SERVED.max_model_len - len(prompt)
    with pytest.raises(APIError) as info:
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]
        _run(serving.chat(ChatCompletionRequest(messages=bad)))
    assert info.value.status == 400 and info.value.param == "messages"
    assert serving.tokenize(parse_body(_tokenize_cls(), b'{"prompt": "ab"}')).tokens == [97, 98]
    with pytest.raises(APIError):
        serving.detokenize(parse_body(_detokenize_cls(), b'{"tokens": [-1]}'))


def _tokenize_cls() -> Any:
    from cbserve.frontend.protocol import TokenizeRequest

    return TokenizeRequest


def _detokenize_cls() -> Any:
    from cbserve.frontend.protocol import DetokenizeRequest

    return DetokenizeRequest


@pytest.mark.parametrize("prompts", [["x"], ["x", "y"]])  # two prompts: two engine streams, merged
def test_a_stream_closed_early_releases_the_engine_streams_at_once(prompts: list[str]) -> None:
    """The client went away after the first chunk: closing the SSE stream closes the engine's streams before
    aclose() returns (not when the garbage collector gets to them), which is what aborts them in the engine."""

    def endless(req: EngineRequest) -> Any:
        while True:
            yield [out(req.req_id, "a", index=i) for i in range(req.sampling_params.n)]

    async def cut_short() -> tuple[list[str], list[str]]:
        serving, engine = _serving(endless)
        stream = await serving.completions(CompletionRequest(prompt=prompts, stream=True, max_tokens=50))
        await anext(stream)
        await stream.aclose()
        return [r.req_id for r in engine.requests], list(engine.closed)

    started, closed = _run(cut_short())
    assert len(started) == len(prompts) and sorted(closed) == sorted(started)
