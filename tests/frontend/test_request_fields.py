"""Request fields of issue 18 without Ray: refused fields are 400s naming them, unknown ones are logged once,
and the honoured ones reach the engine request (token constraints, prompt logprobs, echo, priority, cache
salt, request id, chat template options, prompt truncation); min_tokens holds back stop strings."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from frontend_fakes import EOS, CharTokenizer, ScriptedEngine, ids, out, parse_body

from cbserve.frontend.field_policy import CHAT_REFUSED, REFUSED
from cbserve.frontend.protocol import APIError, ChatCompletionRequest, CompletionRequest
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.text.detokenizer import IncrementalDetokenizer
from cbserve.frontend.validation import ServedModel
from cbserve.scheduler.requests.request import EngineRequest

SERVED = ServedModel(name="m", max_model_len=64, max_n=4, vocab_size=0x3000)
CHAT = [{"role": "user", "content": "hi"}]

# a value each refused field is refused with
REFUSED_VALUES: dict[str, Any] = {
    "suffix": "x", "spaces_between_special_tokens": False, "return_tokens_as_token_ids": True,
    "return_token_ids": True, "logits_processors": ["a.b"], "vllm_xargs": {"a": 1},
    "prompt_embeds": "AAAA", "store": True, "metadata": {"a": "b"}, "service_tier": "flex",
    "prompt_cache_key": "k", "documents": [{"a": "b"}],
    "mm_processor_kwargs": {"a": 1}, "audio": {"voice": "x"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {"a": 1}, "functions": [{"name": "f"}], "function_call": "auto",
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= 'a'",
    "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " ", "echo": True,
}


def _serving(script: Any = None, **served: Any) -> tuple[OpenAIServing, ScriptedEngine]:
    def ok(req: EngineRequest) -> list[list[Any]]:
        return [[out(req.req_id, "ok", finished=True, reason="length")]]

    engine = ScriptedEngine(script or ok)
    return OpenAIServing(ServedModel(**{**SERVED.__dict__, **served}), CharTokenizer(), engine, [EOS]), engine


def _chat(serving: OpenAIServing, **kw: Any) -> Any:
    return asyncio.run(serving.chat(parse_body(ChatCompletionRequest, _json({"messages": CHAT, **kw}))))


def _completion(serving: OpenAIServing, **kw: Any) -> Any:
    return asyncio.run(serving.completions(parse_body(CompletionRequest, _json({"prompt": "abc", **kw}))))


def _json(d: dict[str, Any]) -> bytes:
    import json

    return json.dumps(d).encode()


def test_every_refused_field_has_a_refused_value_here() -> None:
    assert set(REFUSED) | set(CHAT_REFUSED) == set(REFUSED_VALUES)


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_refused_fields_are_400s_naming_them(name: str) -> None:
    serving, engine = _serving()
    chat_only = name in ChatCompletionRequest.model_fields and name not in CompletionRequest.model_fields
    for call in (_chat,) if chat_only or name in ("echo", "return_token_ids") else (_chat, _completion):
        with pytest.raises(APIError) as info:
            call(serving, **{name: REFUSED_VALUES[name]})
        assert info.value.status == 400 and info.value.param == name and name in info.value.message
    assert engine.requests == []


def test_harmless_values_of_refused_fields_and_unknown_fields_pass(caplog: pytest.LogCaptureFixture) -> None:
    serving, engine = _serving()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _chat(serving, response_format={"type": "text"}, tool_choice="none", service_tier="auto", store=False,
                  modalities=["text"], frobnicate=1, user="u")
    assert len(engine.requests) == 2
    assert [r.message for r in caplog.records].count(
        "ignoring unknown request field 'frobnicate' (ChatCompletionRequest); logged once") == 1


def test_structured_output_and_tool_fields_reach_the_engine() -> None:
    """response_format / structured_outputs / tools / tool_choice / parallel_tool_calls are honoured (their
    effect on the output: tests/worker/test_structured.py, tests/e2e/test_structured_output.py); the older
    guided_* fields are refused in favour of structured_outputs."""
    serving, engine = _serving(max_model_len=512)  # the tools take room in the prompt
    serving.grammars.check = lambda spec, param: None  # the character tokenizer has no xgrammar vocabulary
    _completion(serving, structured_outputs={"regex": "a+"})
    _chat(serving, response_format={"type": "json_object"})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    _chat(serving, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    specs = [r.sampling_params.structured for r in engine.requests]
    assert [(s.kind, s.spec) for s in specs[:2]] == [("regex", "a+"), ("json_object", "")]
    assert specs[2].kind == "json" and '"maxItems": 1' in specs[2].spec  # one forced call of f
    with pytest.raises(APIError, match="use structured_outputs") as info:
        _chat(serving, guided_regex="a+")
    assert info.value.param == "guided_regex" and len(engine.requests) == 3


def test_token_constraints_reach_the_engine_and_bad_values_are_refused() -> None:
    serving, engine = _serving()
    _completion(serving, logit_bias={"97": 5, "98": -100}, allowed_token_ids=[97, 98], bad_words=["ab", " c"])
    sp = engine.requests[0].sampling_params
    assert sp.logit_bias == ((97, 5.0), (98, -100.0)) and sp.allowed_token_ids == (97, 98)
    assert sp.bad_words_token_ids == (tuple(ids("ab")), tuple(ids(" ab")), tuple(ids("c")), tuple(ids(" c")))
    for bad, param in [({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
                       ({"logit_bias": {"5": 101}}, None), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                       ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                       ({"max_tokens": 0}, "max_tokens"), ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
                       ({"priority": 1}, "priority")]:
        with pytest.raises(APIError) as info:
            _completion(serving, **bad)
        assert info.value.status == 400 and info.value.param == param, bad
        assert param is None or param in info.value.message


def test_priority_cache_salt_request_id_and_truncation_reach_the_engine() -> None:
    serving, engine = _serving(priority_ordering=True)
    r = _completion(serving, priority=-3, cache_salt="s1", request_id="abc", truncate_prompt_tokens=2)
    q = engine.requests[0]
    assert (q.priority, q.cache_salt, q.prompt_token_ids) == (-3, "s1", ids("bc"))
    assert r.id == "cmpl-abc" and q.req_id == "cmpl-abc"
    assert asyncio.run(serving.completions(CompletionRequest(prompt="x"), request_id="hdr")).id == "cmpl-hdr"


def test_echo_with_max_tokens_zero_returns_the_prompt_alone() -> None:
    serving, engine = _serving()
    r = _completion(serving, echo=True, max_tokens=0, logprobs=0)
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.tokens == ["a", "b", "c"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 0, 3)
    assert engine.requests[0].sampling_params.max_tokens == 1


def test_chat_template_options() -> None:
    serving, engine = _serving()
    _chat(serving, chat_template_kwargs={"enable_thinking": False})
    _chat(serving, continue_final_message=True, add_generation_prompt=False,
          messages=CHAT + [{"role": "assistant", "content": "Sure"}])
    texts = ["".join(map(chr, q.prompt_token_ids)) for q in engine.requests]
    assert texts == ["<user>hi[enable_thinking=False]</><assistant>", "<user>hi<assistant>Sure"]
    for bad in ({"continue_final_message": True}, {"chat_template_kwargs": {"tokenize": True}}):
        with pytest.raises(APIError) as info:
            _chat(serving, **bad)
        assert info.value.status == 400 and info.value.param in bad


def test_min_tokens_holds_back_stop_strings() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), ids("p"), stop=["x"], min_tokens=2)
    assert detok.add_tokens(ids("ax")).new_text == "ax" and not detok.stopped  # 2 tokens: not more than 2
    update = detok.add_tokens(ids("bxc"))
    assert update.stopped and detok.text == "axb"


def test_streamed_echo_with_logprobs_sends_the_prompt_with_the_first_delta() -> None:
    from cbserve.scheduler.outputs import TokenLogprob

    def script(req: EngineRequest) -> list[list[Any]]:
        prompt_lp = [None] + [TokenLogprob(t, -1.0, 1, [(t, -1.0)]) for t in req.prompt_token_ids[1:]]
        first = out(req.req_id, "o", new_logprobs=[TokenLogprob(ord("o"), -0.5, 1, [])], prompt_logprobs=prompt_lp)
        return [[first], [out(req.req_id, "k", finished=True, reason="length",
                              new_logprobs=[TokenLogprob(ord("k"), -0.25, 1, [])])]]

    serving, _ = _serving(script)

    async def collect() -> list[str]:
        stream = await serving.completions(CompletionRequest(prompt="abc", echo=True, logprobs=0, stream=True))
        return [line async for line in stream]

    import json

    chunks = [json.loads(line.removeprefix("data: ")) for line in asyncio.run(collect())[:-1]]
    first, second = chunks[0]["choices"][0], chunks[1]["choices"][0]
    assert first["text"] == "abco" and first["logprobs"]["tokens"] == ["a", "b", "c", "o"]
    assert first["logprobs"]["token_logprobs"] == [None, -1.0, -1.0, -0.5]
    assert first["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert second["text"] == "k" and second["logprobs"]["text_offset"] == [4]


def test_return_token_ids_gives_each_choice_its_prompt_and_generated_ids() -> None:
    serving, _ = _serving()
    r = _completion(serving, return_token_ids=True)
    assert r.choices[0].prompt_token_ids == [ord(c) for c in "abc"] and r.choices[0].token_ids
    assert _completion(serving).choices[0].token_ids is None
    with pytest.raises(APIError, match="not supported with stream"):
        _completion(serving, return_token_ids=True, stream=True)
