"""Issue 18 through the official ``openai`` client against the real server: logit_bias forces and bans tokens,
echo with logprobs and vLLM's prompt_logprobs give the prompt tokens' logprobs (first None), every request
field is honoured (asserted by its effect) or refused with a 400 naming it, cache_salt keeps prefix-cache
entries apart, the request id comes back, /openapi.json documents the request fields, and lm-eval-harness's
own OpenAI-completions model computes log-likelihoods equal to HF transformers' within 1e-4."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from .cases import PROMPTS
from .conftest import API_KEY, Server

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

PROMPT = PROMPTS[0]


def _greedy(server: Server, **kw: Any) -> Any:
    args = dict(model=server.main.model, prompt=PROMPT, max_tokens=6, temperature=0)
    return server.main.client().completions.create(**{**args, **kw})


def _token_ids(server: Server, text: str) -> list[int]:
    status, body = server.main.http("POST", "/tokenize", {"prompt": text})
    assert status == 200, body
    return body["tokens"]


def test_logit_bias_forces_and_bans_tokens(server: Server) -> None:
    free = _greedy(server, extra_body={"ignore_eos": True})
    free_ids = _token_ids(server, free.choices[0].text)
    forced_id = _token_ids(server, " banana")[0]
    forced = _greedy(server, logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True})
    assert _token_ids(server, forced.choices[0].text) == [forced_id] * 6
    banned = _greedy(server, logit_bias={str(t): -100 for t in free_ids}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text and not set(_token_ids(server, banned.choices[0].text)) & set(free_ids)
    chat = server.main.client().chat.completions.create(
        model=server.main.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logit_bias={str(forced_id): 100},
    )
    assert chat.choices[0].message.content == " banana" * 4


def test_echo_with_logprobs_and_prompt_logprobs(server: Server) -> None:
    prompt_ids = _token_ids(server, PROMPT)
    r = _greedy(server, echo=True, logprobs=2, max_tokens=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    only = _greedy(server, echo=True, logprobs=0, max_tokens=0)  # lm-eval's max_tokens=0 form
    assert only.choices[0].text == PROMPT and only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    vllm = _greedy(server, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = vllm.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == n and plp[0] is None
    for pos in range(1, n):
        entry = plp[pos][str(prompt_ids[pos])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[pos], abs=1e-5)
        assert entry["rank"] >= 1 and entry["decoded_token"] == lp.tokens[pos]
    chat = server.main.client().chat.completions.create(
        model=server.main.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


# ---- the table: every request field honoured (its effect asserted) or refused with a 400 naming it ----------
Check = Callable[[Server, Any], None]


def _same_as_greedy(server: Server, r: Any) -> None:
    assert r.choices[0].text == _greedy(server).choices[0].text


def _text_differs_from_greedy(server: Server, r: Any) -> None:
    assert r.choices[0].text != _greedy(server).choices[0].text


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
HONOURED: dict[str, tuple[dict[str, Any], Check]] = {
    "max_tokens": ({"max_tokens": 2, "extra_body": {"ignore_eos": True}},
                   lambda s, r: r.usage.completion_tokens == 2 or pytest.fail("max_tokens")),
    "n": ({"n": 2, "temperature": 1.0}, lambda s, r: [c.index for c in r.choices] == [0, 1] or pytest.fail("n")),
    "best_of": ({"n": 1, "best_of": 2, "temperature": 1.0, "seed": 1},
                lambda s, r: len(r.choices) == 1 or pytest.fail()),
    "temperature": ({"temperature": 0}, _same_as_greedy),
    "top_p": ({"temperature": 1.0, "top_p": 1e-6, "seed": 5}, _same_as_greedy),
    "top_k": ({"temperature": 1.0, "extra_body": {"top_k": 1}, "seed": 5}, _same_as_greedy),
    "min_p": ({"temperature": 1.0, "extra_body": {"min_p": 1.0}, "seed": 5}, _same_as_greedy),
    "frequency_penalty": ({"frequency_penalty": 2.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}},
                          lambda s, r: r.choices[0].text != _greedy(s, max_tokens=24, extra_body={
                              "ignore_eos": True}).choices[0].text or pytest.fail()),
    "presence_penalty": ({"presence_penalty": 2.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}},
                         lambda s, r: r.choices[0].text != _greedy(s, max_tokens=24, extra_body={
                             "ignore_eos": True}).choices[0].text or pytest.fail()),
    "repetition_penalty": ({"max_tokens": 24, "extra_body": {"repetition_penalty": 3.0, "ignore_eos": True}},
                           lambda s, r: r.choices[0].text != _greedy(s, max_tokens=24, extra_body={
                               "ignore_eos": True}).choices[0].text or pytest.fail()),
    "seed": ({"temperature": 1.0, "seed": 42, "max_tokens": 8},
             lambda s, r: r.choices[0].text == _greedy(s, temperature=1.0, seed=42, max_tokens=8).choices[0].text
             or pytest.fail()),
    "stop": ({"stop": ["\n", " "], "max_tokens": 16, "extra_body": {"ignore_eos": True}},
             lambda s, r: (r.choices[0].finish_reason == "stop" and " " not in r.choices[0].text.strip())
             or pytest.fail()),
    "logprobs": ({"logprobs": 2}, lambda s, r: len(r.choices[0].logprobs.top_logprobs[0]) >= 2 or pytest.fail()),
    "echo": ({"echo": True}, lambda s, r: r.choices[0].text.startswith(PROMPT) or pytest.fail()),
    "user": ({"user": "someone"}, _same_as_greedy),  # an identifier: no effect by definition
    "ignore_eos": ({"max_tokens": 30, "extra_body": {"ignore_eos": True}},
                   lambda s, r: r.usage.completion_tokens == 30 or pytest.fail()),
    "min_tokens": ({"max_tokens": 30, "stop": [" "], "extra_body": {"min_tokens": 5}},
                   lambda s, r: r.usage.completion_tokens >= 5 or pytest.fail()),
    "stop_token_ids": ({"logit_bias": {"21285": 100}, "extra_body": {"stop_token_ids": [21285]}},  # " banana"
                       lambda s, r: (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
                       or pytest.fail()),
    "include_stop_str_in_output": ({"stop": [" "], "max_tokens": 16,
                                    "extra_body": {"include_stop_str_in_output": True}},
                                   lambda s, r: r.choices[0].text.endswith(" ") or pytest.fail()),
    "allowed_token_ids": ({"extra_body": {"allowed_token_ids": [9805, 787]}},  # " yes", " no"
                          lambda s, r: set(r.choices[0].text.split()) <= {"yes", "no"} or pytest.fail()),
    "bad_words": ({"extra_body": {"bad_words": ["the", "The", "a"]}, "max_tokens": 12},
                  lambda s, r: not {" the", " a", "The"} & set(r.choices[0].text.split(" ")) or pytest.fail()),
    "return_token_ids": ({"extra_body": {"return_token_ids": True}},
                         lambda s, r: (r.choices[0].token_ids and r.choices[0].prompt_token_ids) or pytest.fail()),
    "request_id": ({"extra_body": {"request_id": "table-1"}}, lambda s, r: r.id == "cmpl-table-1" or pytest.fail()),
    "truncate_prompt_tokens": ({"extra_body": {"truncate_prompt_tokens": 2}, "max_tokens": 1},
                               lambda s, r: r.usage.prompt_tokens == 2 or pytest.fail()),
    "add_special_tokens": ({"extra_body": {"add_special_tokens": False}}, _same_as_greedy),
    "skip_special_tokens": ({"extra_body": {"skip_special_tokens": False}}, _same_as_greedy),
    "safety_identifier": ({"extra_body": {"safety_identifier": "someone"}}, _same_as_greedy),  # an identifier too
    "use_beam_search": ({"n": 2, "extra_body": {"use_beam_search": True}},
                        lambda s, r: len({c.text for c in r.choices}) == 2 or pytest.fail()),
    "structured_outputs": ({"max_tokens": 16, "extra_body": {"structured_outputs": {"regex": "(yes|no)-[0-9]{2}"}}},
                           lambda s, r: (re.fullmatch("(yes|no)-[0-9]{2}", r.choices[0].text)
                                         and r.choices[0].finish_reason == "stop") or pytest.fail()),
    "response_format": ({"max_tokens": 24, "extra_body": {"response_format": {"type": "json_schema", "json_schema": {
                            "name": "ok", "schema": OK_SCHEMA}}}},
                        lambda s, r: isinstance(json.loads(r.choices[0].text)["ok"], bool) or pytest.fail()),
}
# honoured, their effect asserted by another test
ELSEWHERE = {
    "model": "test_api.py::test_bad_inputs_get_openai_errors (404 for another model)",
    "prompt": "everywhere", "messages": "everywhere",
    "stream": "test_api.py::test_completion_equals_offline_llm", "stream_options": "test_api.py (include_usage)",
    "max_completion_tokens": "test_api.py::test_max_completion_tokens_and_length",
    "top_logprobs": "test_api.py::test_n_logprobs_and_seed",
    "length_penalty": "tests/scheduler/test_beam_search.py (the ranking of finished beams)",
    "logit_bias": "test_logit_bias_forces_and_bans_tokens",
    "prompt_logprobs": "test_echo_with_logprobs_and_prompt_logprobs",
    "cache_salt": "test_cache_salt_separates_prefix_cache_entries",
    "continue_final_message": "test_chat_fields_continue_final_message_and_template_kwargs",
    "add_generation_prompt": "test_chat_fields_continue_final_message_and_template_kwargs",
    "chat_template": "test_chat_fields_continue_final_message_and_template_kwargs",
    "chat_template_kwargs": "tests/frontend/test_request_fields.py::test_chat_template_options",
    "priority": "refused here (ordering fcfs); tests/frontend/test_request_fields.py and the scheduler's tests",
    "tools": "tests/e2e/test_structured_output.py (named, required and auto tool calls, LangChain bind_tools)",
    "tool_choice": "tests/e2e/test_structured_output.py::test_named_and_required_tool_calls",
    "parallel_tool_calls": "tests/e2e/test_structured_output.py::test_named_and_required_tool_calls",
    "retention_directives": "tests/e2e/test_kv_retention_served.py (a flood does not evict the hinted prefix)",
    "prompt_cache_retention": "tests/e2e/test_kv_retention_served.py (a flood does not evict the hinted prefix)",
}

REFUSED: dict[str, Any] = {
    "suffix": "x", "priority": 1, "spaces_between_special_tokens": False, "return_tokens_as_token_ids": True,
    "logits_processors": ["x"], "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "prompt_embeds": "AAAA", "store": True, "metadata": {"a": "b"}, "service_tier": "flex", "prompt_cache_key": "k",
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a"],
    "guided_grammar": "root ::= 'a'", "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " ",
}
CHAT_REFUSED: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["audio"],
    "reasoning_effort": "low", "prediction": {"type": "content", "content": "x"}, "echo": True,
    "web_search_options": {}, "functions": [{"name": "f"}], "function_call": "auto", "verbosity": "low",
    "documents": [{"a": "b"}], "mm_processor_kwargs": {"a": 1}, "return_token_ids": True,
}


def test_the_table_covers_every_request_field() -> None:
    from cbserve.frontend.protocol import ChatCompletionRequest, CompletionRequest

    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    listed = [set(HONOURED), set(REFUSED), set(CHAT_REFUSED), set(ELSEWHERE)]
    assert set().union(*listed) == fields
    assert not HONOURED.keys() & (REFUSED.keys() | ELSEWHERE.keys())
    assert HONOURED.keys() & CHAT_REFUSED.keys() == {"echo", "return_token_ids"}  # completions only; chat refuses them


@pytest.mark.parametrize("field", sorted(HONOURED))
def test_honoured_completion_fields_have_their_effect(server: Server, field: str) -> None:
    kw, check = HONOURED[field]
    check(server, _greedy(server, **kw))


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_completion_fields_are_400s_naming_them(server: Server, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _greedy(server, extra_body={field: REFUSED[field]})
    assert info.value.body["param"] == field and field in info.value.body["message"]


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_refused_chat_fields_are_400s_naming_them(server: Server, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.main.client().chat.completions.create(
            model=server.main.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={field: CHAT_REFUSED[field]},
        )
    assert info.value.body["param"] == field and field in info.value.body["message"]


def test_chat_fields_continue_final_message_and_template_kwargs(server: Server) -> None:
    client = server.main.client()
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]
    r = client.chat.completions.create(model=server.main.model, messages=msgs, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    status, body = server.main.http("POST", "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert r.usage.prompt_tokens < body["count"]  # the last message left open: no end-of-turn tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.main.model, messages=msgs, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"
    plain = client.chat.completions.create(model=server.main.model, messages=msgs[:1], max_tokens=1)
    other = client.chat.completions.create(model=server.main.model, messages=msgs[:1], max_tokens=1,
                                           extra_body={"chat_template": "{{ messages[0]['content'] }}"})
    assert other.usage.prompt_tokens == len(_token_ids(server, "Name a fruit.")) < plain.usage.prompt_tokens


def test_cache_salt_separates_prefix_cache_entries(server: Server) -> None:
    prompt = "Salted prefix caching keeps tenants apart. " * 6

    def hits(**kw: Any) -> int:
        before = sum(r["prefix_cache_hits"] for r in server.main.stats().values())
        _greedy(server, prompt=prompt, max_tokens=1, **kw)
        return sum(r["prefix_cache_hits"] for r in server.main.stats().values()) - before

    hits(extra_body={"cache_salt": "tenant-a"})
    assert hits(extra_body={"cache_salt": "tenant-b"}) == 0
    assert hits(extra_body={"cache_salt": "tenant-a"}) > 0


def test_request_id_header_is_echoed(server: Server) -> None:
    client = server.main.client()
    raw = client.completions.with_raw_response.create(
        model=server.main.model, prompt=PROMPT, max_tokens=1, extra_headers={"X-Request-Id": "hdr-7"}
    )
    assert raw.headers["x-request-id"] == "hdr-7" and raw.parse().id == "cmpl-hdr-7"
    raw = client.chat.completions.with_raw_response.create(
        model=server.main.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert raw.headers["x-request-id"] and raw.parse().id == f"chatcmpl-{raw.headers['x-request-id']}"


def test_openapi_documents_the_request_fields(server: Server) -> None:
    status, doc = server.main.http("GET", "/openapi.json")
    assert status == 200
    schemas = doc["components"]["schemas"]
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = schemas[ref["$ref"].rsplit("/", 1)[1]]["properties"]
    documented = {"logit_bias", "prompt_logprobs", "tools", "response_format", "chat_template_kwargs", "cache_salt"}
    assert documented <= set(chat)
    assert "prompt_logprobs" in schemas["CompletionChoice"]["properties"]


def test_lm_eval_loglikelihood_equals_hf_transformers(server: Server) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM

    from cbserve.frontend.model_files import model_folder

    assert lm_eval is not None
    folder = model_folder(None)
    lm = LocalCompletionsAPI(
        model=server.main.model, base_url=f"{server.main.base_url}/v1/completions", tokenizer_backend="huggingface",
        tokenizer=str(folder), header={"Authorization": f"Bearer {API_KEY}"}, max_retries=1, timeout=120,
    )
    pairs = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"), ("Once upon a time, there", " was a"),
             ("The color of the sky is", " green and purple"), ("def add(a, b):\n", "    return a + b")]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    # per token: 1e-4 on float32 products, 5e-3 with rows rounded to int16 (the defaults on a CPU with VNNI)
    cpus = [cpu for replica in server.main.stats().values() for cpu in replica["worker_cpu"]]
    per_token = 5e-3 if any(cpu["cpu_decode_activations"] == "int16" for cpu in cpus) else 1e-4
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    for (ctx, cont), (ll, greedy) in zip(pairs, got, strict=True):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        seq = ctx_ids + cont_ids
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
        picked = [lp[i - 1, seq[i]] for i in range(len(ctx_ids), len(seq))]
        want = float(sum(picked))
        want_greedy = all(int(lp[i - 1].argmax()) == seq[i] for i in range(len(ctx_ids), len(seq)))
        assert abs(ll - want) < per_token * len(cont_ids), (ctx, cont, ll, want)
        assert greedy == want_greedy, (ctx, cont)
