"""``/v1/embeddings`` without Ray (``OpenAIServing.embeddings``): inputs in every shape, truncation and length
refusals, ``dimensions`` on Matryoshka models only, base64, usage, runner refusals both ways, and the engine
requests (one per input, aborted when another fails), over an engine that pools scripted vectors."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from typing import Any

import pytest
from frontend_fakes import EOS, CharTokenizer, ScriptedEngine, parse_body

from cbserve.frontend.embeddings import EmbeddingRequest, EmbeddingResponse
from cbserve.frontend.protocol import APIError, ChatCompletionRequest, CompletionRequest
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.validation import ServedModel
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput
from cbserve.worker.loading.pooling_config import PoolingConfig

SERVED = ServedModel(name="m", max_model_len=8, max_n=4, vocab_size=0x3000, runner="pooling",
                     pooling=PoolingConfig("mean", True, True, None))


def vector(prompt: list[int]) -> list[float]:
    """The fake model's embedding: (len, first token, 2, 2), normalized."""
    raw = [float(len(prompt)), float(prompt[0]), 2.0, 2.0]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


def pooled(req: EngineRequest) -> list[list[RequestOutput]]:
    done = RequestOutput(req.req_id, 0, [], None, True, "stop", len(req.prompt_token_ids), 0,
                         embedding=vector(req.prompt_token_ids))
    return [[], [done]]


def _serving(served: ServedModel = SERVED, script: Any = pooled) -> tuple[OpenAIServing, ScriptedEngine]:
    engine = ScriptedEngine(script)
    return OpenAIServing(served, CharTokenizer(), engine, [EOS]), engine


def _embed(serving: OpenAIServing, **body: Any) -> dict[str, Any]:
    req = parse_body(EmbeddingRequest, EmbeddingRequest(**body).model_dump_json(exclude_unset=True).encode())
    response = asyncio.run(serving.embeddings(req, body.pop("request_id", None)))
    assert isinstance(response, EmbeddingResponse)
    return response.model_dump()


def _error(serving: OpenAIServing, **body: Any) -> APIError:
    with pytest.raises(APIError) as info:
        _embed(serving, **body)
    return info.value


@pytest.mark.parametrize("inp, prompts", [
    ("abc", ["abc"]),
    (["abc", "de"], ["abc", "de"]),
    ([97, 98], ["ab"]),
    ([[97], [98, 99, 100]], ["a", "bcd"]),
])  # fmt: skip
def test_inputs_in_every_shape(inp: Any, prompts: list[str]) -> None:
    serving, engine = _serving()
    r = _embed(serving, input=inp, model="m")
    ids = [[ord(c) for c in p] for p in prompts]
    assert [q.prompt_token_ids for q in engine.requests] == ids
    assert all(q.sampling_params.max_tokens == 1 for q in engine.requests)
    assert r["object"] == "list" and r["model"] == "m" and r["id"].startswith("embd-")
    assert r["data"] == [{"object": "embedding", "index": i, "embedding": vector(p)} for i, p in enumerate(ids)]
    n = sum(map(len, ids))
    assert r["usage"] == {"prompt_tokens": n, "total_tokens": n}
    if len(ids) > 1:  # one engine request per input, named after the response
        assert [q.req_id for q in engine.requests] == [f"{r['id']}-{i}" for i in range(len(ids))]


def test_base64_is_little_endian_float32() -> None:
    serving, _ = _serving()
    r = _embed(serving, input="abc", encoding_format="base64", request_id="x1")
    assert r["id"] == "embd-x1"
    raw = base64.b64decode(r["data"][0]["embedding"])
    assert list(struct.unpack("<4f", raw)) == pytest.approx(vector([97, 98, 99]), rel=1e-6)


def test_long_inputs_are_refused_unless_truncated() -> None:
    serving, engine = _serving()
    e = _error(serving, input=["ok", "abcdefghij"])
    assert e.status == 400 and e.param == "input" and "maximum context length is 8" in e.message
    assert engine.requests == []  # checked before any request starts
    _embed(serving, input=["ok", "abcdefghij"], truncate_prompt_tokens=8)
    assert engine.requests[1].prompt_token_ids == [ord(c) for c in "cdefghij"]  # the last 8 tokens
    _embed(serving, input="abcdefghij", truncate_prompt_tokens=-1)
    assert len(engine.requests[-1].prompt_token_ids) == 8
    assert _error(serving, input="abc", truncate_prompt_tokens=9).param == "truncate_prompt_tokens"
    for empty in ("", [], [[]]):
        assert _error(serving, input=empty).param == "input"
    assert _error(serving, input=[0x3000]).param == "input"  # outside the vocabulary


def test_dimensions_on_matryoshka_models_only() -> None:
    serving, _ = _serving()
    r = _embed(serving, input="abc", dimensions=2)
    full = vector([97, 98, 99])
    norm = math.hypot(full[0], full[1])
    assert r["data"][0]["embedding"] == pytest.approx([full[0] / norm, full[1] / norm])
    assert _error(serving, input="abc", dimensions=5).param == "dimensions"  # more than the model's
    assert _error(serving, input="abc", dimensions=0).param == "dimensions"
    listed = ServedModel(**{**SERVED.__dict__, "pooling": PoolingConfig("mean", True, True, (2, 4))})
    assert _embed(_serving(listed)[0], input="abc", dimensions=4)["data"][0]["embedding"] == pytest.approx(full)
    assert "only supports dimensions [2, 4]" in _error(_serving(listed)[0], input="abc", dimensions=3).message
    plain = ServedModel(**{**SERVED.__dict__, "pooling": PoolingConfig()})
    e = _error(_serving(plain)[0], input="abc", dimensions=2)
    assert e.status == 400 and e.param == "dimensions" and "Matryoshka" in e.message


def test_runners_refuse_each_others_endpoints() -> None:
    serving, _ = _serving()
    for call in (serving.completions(CompletionRequest(prompt="ab")),
                 serving.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))):
        with pytest.raises(APIError, match="runner 'pooling'") as info:
            asyncio.run(call)
        assert info.value.status == 400
    generating = ServedModel(name="m", max_model_len=8, max_n=4, vocab_size=0x3000)
    e = _error(_serving(generating)[0], input="abc")
    assert e.status == 400 and "--runner pooling" in e.message
    assert _error(serving, input="abc", model="other").status == 404
    assert _error(serving, input="abc", priority=1).param == "priority"  # needs the priority ordering


def test_a_failing_input_aborts_the_others() -> None:
    def script(req: EngineRequest) -> list[list[RequestOutput]]:
        if req.prompt_token_ids == [ord("x")]:
            raise APIError(429, "overloaded")
        return [[], [], [], [], pooled(req)[1]]

    serving, engine = _serving(script=script)
    e = _error(serving, input=["abc", "x", "de"])
    assert e.status == 429
    assert sorted(engine.closed) == sorted(q.req_id for q in engine.requests)  # every stream released


def test_a_request_finished_without_a_vector_is_an_error() -> None:
    def script(req: EngineRequest) -> list[list[RequestOutput]]:
        return [[RequestOutput(req.req_id, 0, [], None, True, "abort", 3, 0)]]

    e = _error(_serving(script=script)[0], input="abc")
    assert e.status == 500 and "without an embedding" in e.message
