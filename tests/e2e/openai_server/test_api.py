"""The OpenAI API through the official client against the real server: outputs equal the offline LLM,
streaming, n, logprobs, seed, stop strings, token limits, errors, API key, /tokenize and /detokenize."""

from __future__ import annotations

import pytest

from .cases import CHAT, MAX_TOKENS, PROMPTS
from .conftest import API_KEY, MAX_MODEL_LEN, Server

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_models_and_health(server: Server) -> None:
    models = server.main.client().models.list()
    assert [m.id for m in models.data] == [server.main.model]
    status, body = server.main.http("GET", "/health", key=None)
    assert status == 200 and body["status"] == "ok" and len(body["replicas"]) == 2


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_offline_llm(server: Server, prompt: str) -> None:
    client = server.main.client()
    want = server.expected[f"main:{prompt}"]
    r = client.completions.create(model=server.main.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens <= MAX_TOKENS and r.usage.prompt_tokens > 0
    chunks = list(
        client.completions.create(
            model=server.main.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_chat_equals_offline_llm(server: Server) -> None:
    client = server.main.client()
    want = server.expected["main:chat"]
    r = client.chat.completions.create(model=server.main.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=server.main.model, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_n_logprobs_and_seed(server: Server) -> None:
    client = server.main.client()
    kw = dict(model=server.main.model, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, n=3, seed=1234,
              logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # seed + i per sequence: not all the same
    for c in a.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.text_offset) == 6
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    assert a.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=server.main.model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, n=2
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs.content
    assert 1 <= len(content) <= 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-4)  # greedy = top


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_output(server: Server, stream: bool) -> None:
    client = server.main.client()
    full = server.expected[f"main:{PROMPTS[1]}"]
    stop = full.strip().split()[2]  # a word from the middle of the greedy output
    want = full[: full.index(stop)]
    kw = dict(model=server.main.model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (text, reason) == (want, "stop")


def test_max_completion_tokens_and_length(server: Server) -> None:
    r = server.main.client().chat.completions.create(
        model=server.main.model, messages=CHAT, max_completion_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def _bad_requests(model: str) -> list[tuple[str, int, dict | bytes]]:
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    return [
        ("malformed json", 400, b'{"model": "x", "prompt": '),
        ("unknown model", 404, {"model": "no-such-model", "prompt": "hi"}),
        ("prompt too long", 400, {"model": model, "prompt": long_prompt, "max_tokens": 4}),
        ("max_tokens over context", 400, {"model": model, "prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}),
        ("negative temperature", 400, {"model": model, "prompt": "hi", "temperature": -1}),
        ("top_p over 1", 400, {"model": model, "prompt": "hi", "top_p": 1.5}),
        ("n too large", 400, {"model": model, "prompt": "hi", "n": 1000}),
        ("empty prompt", 400, {"model": model, "prompt": ""}),
        ("wrong type", 400, {"model": model, "prompt": "hi", "max_tokens": "many"}),
        ("token id past the vocabulary", 400, {"model": model, "prompt": [1, 2, 10**9], "max_tokens": 4}),
        ("suffix (insertion) unsupported", 400, {"model": model, "prompt": "hi", "suffix": "end"}),
        ("negative token id", 400, {"model": model, "prompt": [[5] * 40 + [-3]], "max_tokens": 4}),
        ("chat: negative temperature", 400, {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                             "temperature": -1}),
        ("chat: n too large", 400, {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": 1000}),
    ]


def test_bad_inputs_get_openai_errors(server: Server) -> None:
    app = server.main
    for what, status, body in _bad_requests(app.model):
        raw = body if isinstance(body, bytes) else None
        route = "/v1/chat/completions" if what.startswith("chat") else "/v1/completions"
        got, payload = app.http("POST", route, None if raw else body, raw=raw)
        assert got == status, (what, payload)
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (what, err)
    got, payload = app.http("POST", "/v1/chat/completions", {"model": app.model, "messages": []})
    assert got == 400 and "messages" in payload["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        app.client().completions.create(model=app.model, prompt="hi", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        app.client().chat.completions.create(model="nope", messages=CHAT)
    r = app.client().completions.create(model=app.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == server.expected[f"main:{PROMPTS[0]}"]  # still serving


def test_api_key_guards_every_route_but_health(server: Server) -> None:
    app = server.main
    for key in (None, "wrong"):
        status, body = app.http("GET", "/v1/models", key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert app.http("POST", "/v1/completions", {"prompt": "hi"}, key=key)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert app.http("GET", "/health", key=None)[0] == 200
    assert app.http("GET", "/v1/models", key=API_KEY)[0] == 200


def test_tokenize_detokenize(server: Server) -> None:
    app = server.main
    status, tok = app.http("POST", "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0
    status, detok = app.http("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == PROMPTS[0]
    status, chat = app.http("POST", "/tokenize", {"messages": CHAT})
    assert status == 200 and chat["count"] > tok["count"]
    assert app.http("POST", "/detokenize", {"tokens": [-1]})[0] == 400
