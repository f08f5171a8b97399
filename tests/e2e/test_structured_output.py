"""Structured output and tool calling through real clients (the official ``openai`` client, LangChain's
``ChatOpenAI``) against a real local Ray Serve cluster. Two apps:

- ``main`` at ``/``: the bundled SmolLM2-135M-Instruct (its chat template knows no tool-call format);
- ``qwen`` at ``/qwen``: a tiny random Llama with SmolLM2's tokenizer and a Qwen2.5-style tool-calling chat
  template, so ``tool_call_parser: auto`` picks the Hermes ``<tool_call>`` parser, and the ``qwen3``
  reasoning parser. Random weights never write a tool call or a ``<think>`` block themselves: both are
  driven end to end by forcing the text with a regex (``structured_outputs``) and checked to return plain
  content otherwise;
- ``emb`` at ``/emb``: ``qwen``'s tiny random Llama served with ``runner: pooling`` (mean pooling + Normalize from its
  sentence-transformers files, Matryoshka), checked against sentence-transformers' ``encode``;
- ``think`` at ``/think``: ``think_model.py``'s tiny Qwen3 whose greedy output thinks a known text, for structured
  output after the reasoning and the OpenAI Agents SDK (``e2e_reasoning.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2e_reasoning
import e2e_responses
import pytest
from e2e_lib import SharedRay, wait_for
from pydantic import BaseModel, Field
from think_model import make_think_model

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1200)]

COMMON = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "max_num_batched_tokens": 512,
          "worker_num_cpus": 1, "worker_torch_threads": 1, "kv_cache_memory_bytes": 48 * 1024**2}  # fmt: skip
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}\n{%- endfor %}\n</tools>\nReturn each call as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    '{%- for m in messages %}{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant\n'
    "{%- for tc in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    '{%- endfor %}<|im_end|>\n{% elif m.role == "tool" %}<|im_start|>user\n<tool_response>\n'
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False},
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=24)


def _make_qwen_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cbserve.frontend.text.tokenizer import load_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = load_tokenizer(None)
    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def _make_embedding_model(qwen: Path, folder: Path) -> Path:
    """The ``qwen`` app's tiny model (copied: nothing more to build) with hand-written sentence-transformers files
    (mean pooling, Normalize) and ``is_matryoshka`` (vLLM's key) in its config."""
    import shutil

    shutil.copytree(qwen, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    modules = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                 ("2_Normalize", "Normalize")])]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    for sub in ("1_Pooling", "2_Normalize"):
        (folder / sub).mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


class Apps:
    def __init__(self, base: str, emb_folder: Path | None = None) -> None:
        self.base = base
        self.emb_folder = emb_folder

    def client(self, prefix: str = "") -> Any:
        return openai.OpenAI(base_url=f"{self.base}{prefix}/v1", api_key="none", max_retries=0, timeout=300)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def apps(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apps]:
    qwen = _make_qwen_model(tmp_path_factory.mktemp("qwen") / "qwen-tools")
    emb = _make_embedding_model(qwen, tmp_path_factory.mktemp("emb") / "emb")
    think = make_think_model(tmp_path_factory.mktemp("think") / "think").folder
    apps = {
        "main": dict(COMMON, max_num_seqs=16),
        "qwen": dict(COMMON, model=str(qwen), served_model_name="qwen", reasoning_parser="qwen3"),
        "emb": dict(COMMON, model=str(emb), served_model_name="emb", runner="pooling", max_num_seqs=8),
        "think": dict(COMMON, model=str(think), served_model_name="think", reasoning_parser="auto", max_num_seqs=4),
    }
    with shared_ray.apps(apps, {"main": "/"}, ready_s=600) as url:
        a = Apps(url, emb)
        healthy = lambda p: a.client(p).with_options(timeout=5).models.list()  # noqa: E731
        wait_for("the apps", lambda: all(healthy(p) for p in ("", "/qwen", "/emb", "/think")), 600, 0.25)
        yield a


def _model(client: Any) -> str:
    return client.models.list().data[0].id


# ---- structured output ----------------------------------------------------------------------------
def test_parse_with_a_pydantic_model(apps: Apps) -> None:
    client = apps.client()
    msgs = [{"role": "user", "content": "Invent a person: name, age and city, as JSON."}]
    r = client.chat.completions.parse(model=_model(client), messages=msgs, response_format=Person,
                                      temperature=0.8, seed=1, max_tokens=120, n=2)  # fmt: skip
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice.message.content
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object_parse_at_temperature(apps: Apps, stream: bool) -> None:
    client = apps.client()
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                      "strict": True}}  # fmt: skip
    for fmt in (schema, {"type": "json_object"}):
        msgs = [{"role": "user", "content": "Describe a person (name, age, city) in JSON."}]
        kw = dict(model=_model(client), messages=msgs, response_format=fmt, temperature=0.7, seed=3, max_tokens=300,
                  n=2)  # fmt: skip
        if stream:
            texts = ["", ""]
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
        else:
            texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
        for text in texts:
            value = json.loads(text)
            assert isinstance(value, dict), text
            if fmt is schema:
                Person.model_validate(value)


def test_regex_and_choice_on_both_endpoints(apps: Apps) -> None:
    client = apps.client()
    model = _model(client)
    r = client.completions.create(model=model, prompt="A product code:", max_tokens=20, temperature=1.0, n=3,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})  # fmt: skip
    import re

    assert all(re.fullmatch("[A-Z]{2}-[0-9]{3}", c.text) and c.finish_reason == "stop" for c in r.choices), r
    choices = ["red", "green", "blue"]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A colour?"}],
                                       temperature=1.0, seed=5, max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": choices}})  # fmt: skip
    assert r.choices[0].message.content in choices


@pytest.mark.parametrize(
    ("body", "match"),
    [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
      "objectx"),
     ({"structured_outputs": {"regex": "a(b"}}, "regex"),
     ({"structured_outputs": {"grammar": "root ::= "}}, "grammar"),
     ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
     ({"tools": [WEATHER]}, "tool_choice 'auto'"),
     ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools")],
)  # fmt: skip
def test_bad_specs_are_400s_naming_the_problem(apps: Apps, body: dict[str, Any], match: str) -> None:
    status, err = apps.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **body})
    assert status == 400 and match in err["error"]["message"], err


# ---- tool calling ---------------------------------------------------------------------------------
def _stream_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += tc.id or ""
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return calls, finish


def _check_weather(args: str) -> None:
    value = json.loads(args)
    assert set(value) == {"city", "days"} and isinstance(value["city"], str) and 1 <= value["days"] <= 7, value


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_calls(apps: Apps, stream: bool) -> None:
    client = apps.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    # seeded, so each case draws the same tokens every run; with parallel calls allowed SmolLM2 keeps adding
    # calls until max_tokens at most seeds (7 of seeds 11-20 still calling at 600 tokens): seed 13 stops
    for choice, parallel in ((named, True), ("required", False), ("required", True)):
        kw = dict(model=_model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0.7,
                  seed=13, max_tokens=150, parallel_tool_calls=parallel)  # fmt: skip
        if stream:
            calls, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
            got = [(c["id"], c["name"], c["arguments"]) for c in calls.values()]
        else:
            r = client.chat.completions.create(**kw)
            finish, msg = r.choices[0].finish_reason, r.choices[0].message
            got = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        assert finish == "tool_calls" and got, (choice, got)
        if not parallel:
            assert len(got) == 1
        for call_id, name, args in got:
            assert call_id.startswith("call_") and name in ("get_weather", "get_time")
            if name == "get_weather":
                _check_weather(args)
            else:
                assert json.loads(args)["tz"] in ("UTC", "CET")
        if choice is named:
            assert [g[1] for g in got] == ["get_weather"]


FORCED_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "days": 3\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_parsed_from_the_models_format(apps: Apps, stream: bool) -> None:
    client = apps.client("/qwen")
    # the regex fixes the text (91 characters), not its tokens: a random model may spell it in short pieces,
    # so max_tokens covers one token per character
    kw = dict(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=100, temperature=0.5,
              extra_body={"structured_outputs": {"regex": FORCED_CALL}})  # fmt: skip
    if stream:
        calls, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
        got = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        r = client.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert r.choices[0].message.content is None
    assert finish == "tool_calls" and got == [("get_weather", '{"city": "Paris", "days": 3}')]
    plain = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=8, seed=1)
    msg = plain.choices[0].message
    assert msg.tool_calls is None and isinstance(msg.content, str) and plain.choices[0].finish_reason == "length"


def test_reasoning_split_token_for_token(apps: Apps) -> None:
    """A forced ``<think>`` block then an answer: reasoning and content are the generated tokens (their
    logprobs' texts) split at the tags, whole and streamed; ``enable_thinking: false`` makes it all content."""
    client = apps.client("/qwen")
    so = {"regex": "<think>[a-z ]{1,20}</think>[A-Za-z ]{1,20}"}
    kw = dict(model="qwen", messages=ASK, max_tokens=80, temperature=0, logprobs=True)
    r = client.chat.completions.create(**kw, extra_body={"structured_outputs": so})
    msg, tokens = r.choices[0].message, [t.token for t in r.choices[0].logprobs.content]
    assert msg.reasoning_content and msg.reasoning == msg.reasoning_content and msg.content
    text = "".join(tokens).removesuffix("<|im_end|>")  # the EOS that ends the grammar is not text
    assert text == f"<think>{msg.reasoning_content}</think>{msg.content}"
    got = {"reasoning_content": "", "reasoning": "", "content": "", "tokens": ""}
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body={"structured_outputs": so}):
        for c in chunk.choices:
            for key in ("reasoning_content", "reasoning", "content"):
                got[key] += getattr(c.delta, key, None) or ""
            got["tokens"] += "".join(t.token for t in c.logprobs.content) if c.logprobs else ""
    assert got == {"reasoning_content": msg.reasoning_content, "reasoning": msg.reasoning_content,
                   "content": msg.content, "tokens": "".join(tokens)}  # fmt: skip
    off = {"structured_outputs": so, "chat_template_kwargs": {"enable_thinking": False}}
    plain = client.chat.completions.create(**kw, extra_body=off).choices[0].message
    assert plain.content == text and getattr(plain, "reasoning_content", None) is None


def test_multi_turn_tool_conversation(apps: Apps) -> None:
    client = apps.client("/qwen")
    first = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=0.3)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]  # fmt: skip
    second = client.chat.completions.create(model="qwen", messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=6, seed=2)  # fmt: skip
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content is not None
    status, tokens = apps.post("/qwen/tokenize", {"messages": history})
    assert status == 200
    status, text = apps.post("/qwen/detokenize", {"tokens": tokens["tokens"]})
    rendered = text["prompt"]
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in rendered
    assert f'{{"name": "get_weather", "arguments": {json.dumps(json.loads(call.function.arguments))}}}' in rendered


# ---- LangChain ------------------------------------------------------------------------------------
def test_langchain_structured_output_and_bind_tools(apps: Apps) -> None:
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    llm = lc.ChatOpenAI(base_url=f"{apps.base}/v1", api_key="none", model=_model(apps.client()), temperature=0.7,
                        max_tokens=150, max_retries=0)  # fmt: skip
    person = llm.with_structured_output(Person, method="json_schema").invoke("Invent a person as JSON.")
    assert isinstance(person, Person)

    @tool
    def get_weather(city: str, days: int) -> str:
        """Current weather of a city for some days."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome for 2 days?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "days"} and isinstance(msg.tool_calls[0]["args"]["days"], int)


# ---- the Responses API (e2e_responses.py) ----------------------------------------------------------------
def test_responses_api_through_the_official_client_and_langchain(apps: Apps) -> None:
    client = apps.client()
    model = _model(client)
    e2e_responses.check_text_whole_and_streamed(client, model)
    e2e_responses.check_forced_tool_call_and_its_answer(client, model)
    e2e_responses.check_langchain_tool_call(f"{apps.base}/v1", model)


# ---- reasoning models (e2e_reasoning.py) -------------------------------------------------------------------
def test_structured_output_after_the_reasoning_and_the_agents_sdk(apps: Apps) -> None:
    e2e_reasoning.check_json_schema_after_reasoning(apps.client("/think"), "think")
    e2e_reasoning.check_forced_tool_call_after_reasoning(apps.client("/think"), "think")
    e2e_reasoning.check_agents_sdk_tool_call(f"{apps.base}/think/v1", "think")


# ---- embeddings (runner: pooling) -----------------------------------------------------------------------
def test_embeddings_match_sentence_transformers(apps: Apps) -> None:
    """The official client asks for base64 (and decodes it); ``dimensions`` cuts the Matryoshka vector and
    renormalizes it; the two runners refuse each other's endpoints."""
    import torch

    st = pytest.importorskip("sentence_transformers")
    texts = ["The quick brown fox", "jumps over the lazy dog, " * 40, "hi"]
    client = apps.client("/emb")
    r = client.embeddings.create(model="emb", input=texts)
    ref = torch.as_tensor(st.SentenceTransformer(str(apps.emb_folder), device="cpu").encode(texts)).double()
    ours = torch.tensor([d.embedding for d in r.data], dtype=torch.float64)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "emb"
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min() >= 0.9999
    assert r.usage.prompt_tokens == r.usage.total_tokens > 200
    cut = client.embeddings.create(model="emb", input=texts[0], dimensions=16, encoding_format="float")
    want = torch.nn.functional.normalize(ref[0, :16], dim=0)
    assert torch.allclose(torch.tensor(cut.data[0].embedding, dtype=torch.float64), want, atol=1e-4)
    status, body = apps.post("/emb/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "runner 'pooling'" in body["error"]["message"], body
    status, body = apps.post("/v1/embeddings", {"input": "hi"})
    assert status == 400 and "--runner pooling" in body["error"]["message"], body
