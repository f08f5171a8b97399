"""``/v1/responses`` without Ray: the translation to and from the chat flow, the store, the refused fields, and the
event stream, over an engine that replays scripted outputs. The official ``openai`` client talks to it through
an httpx mock transport (its own request bodies in, its own parsing of our bodies and SSE events out), and every
streamed event is validated against the client's pydantic event models."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from frontend_fakes import EOS, CharTokenizer, ScriptedEngine, out
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter, ValidationError

from cbserve.frontend.protocol import APIError, ChatCompletionRequest
from cbserve.frontend.responses.api import ResponsesAPI, chat_request
from cbserve.frontend.responses.protocol import ResponseObject, ResponsesRequest
from cbserve.frontend.responses.store import InMemoryResponses, StoredResponses
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.validation import ServedModel, invalid_body_error
from cbserve.scheduler.requests.request import EngineRequest

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


class ToolThinkTokenizer(CharTokenizer):
    """A template with Hermes ``<tool_call>``s and Qwen3's ``enable_thinking`` ("auto" picks both parsers); an
    assistant's tool calls are written ``[name(arguments)]``."""

    chat_template = "<tool_call>{% if enable_thinking %}<think>{% endif %}"

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool,
                            **kw: Any) -> str:  # fmt: skip
        kw.pop("tools", None)
        calls = lambda m: "".join(f"[{c['function']['name']}({json.dumps(c['function']['arguments'])})]"
                                  for c in m.get("tool_calls", []))  # fmt: skip
        msgs = [dict(m, content=m["content"] + calls(m)) for m in messages]
        return super().apply_chat_template(msgs, tokenize, add_generation_prompt, **kw)


def _api(*answers: list[str], reason: str = "stop", store: StoredResponses | None = None) -> tuple[ResponsesAPI, Any]:
    """The k-th request the engine gets generates ``answers[k]``'s pieces, then finishes with ``reason``."""

    def script(req: EngineRequest) -> list[list[Any]]:
        pieces = answers[len(engine.requests) - 1]
        return [[out(req.req_id, p, finished=i == len(pieces) - 1, reason=reason)] for i, p in enumerate(pieces)]

    engine = ScriptedEngine(script)
    served = ServedModel("m", 4096, 4, 0x3000, reasoning_parser="auto")
    serving = OpenAIServing(served, ToolThinkTokenizer(), engine, [EOS])
    serving.grammars.check = lambda spec, param: None  # the character tokenizer has no xgrammar vocabulary
    return ResponsesAPI(serving, store), engine


async def _answer(api: ResponsesAPI, request: httpx.Request) -> Any:
    last = request.url.path.rsplit("/", 1)[-1]
    if request.method == "GET":
        return await api.retrieve(last)
    if request.method == "DELETE":
        return await api.delete(last)
    try:
        body = ResponsesRequest.model_validate_json(request.content)
    except ValidationError as e:
        raise invalid_body_error(e.errors()) from e
    r = await api.create(body)
    return r if isinstance(r, BaseModel) else [line async for line in r]


def _client(api: ResponsesAPI) -> openai.OpenAI:
    """The official client, its HTTP calls answered by ``api`` as the ingress would."""

    def handle(request: httpx.Request) -> httpx.Response:
        try:
            result = asyncio.run(_answer(api, request))
        except APIError as e:
            return httpx.Response(e.status, json=e.body())
        if isinstance(result, list):
            return httpx.Response(200, content="".join(result).encode(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=result.model_dump())

    http = httpx.Client(transport=httpx.MockTransport(handle))
    return openai.OpenAI(base_url="http://test/v1", api_key="none", max_retries=0, http_client=http)


def _events(api: ResponsesAPI, **body: Any) -> list[dict[str, Any]]:
    """The streamed events of a request, each checked against the openai package's event models."""

    async def run() -> list[str]:
        return [line async for line in await api.create(ResponsesRequest(stream=True, **body))]  # type: ignore[union-attr]

    events = []
    for line in asyncio.run(run()):
        head, data = line.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _prompt(engine: Any, k: int = 0) -> str:
    return "".join(chr(t) for t in engine.requests[k].prompt_token_ids)


def _pieces(text: str, step: int) -> list[str]:
    return [text[i : i + step] for i in range(0, len(text), step)]


# ---- whole and streamed answers ---------------------------------------------------------------------------
def test_text_answer_whole_and_streamed_through_the_official_client() -> None:
    api, engine = _api(["Hel", "lo"], ["Hel", "lo"])
    client = _client(api)
    r = client.responses.create(model="m", input="hi", instructions="Be brief.", max_output_tokens=20, temperature=0,
                                top_p=0.5, metadata={"k": "v"}, user="u1")  # fmt: skip
    assert r.output_text == "Hello" and r.status == "completed" and r.id.startswith("resp_")
    assert r.object == "response" and r.model == "m" and r.metadata == {"k": "v"} and r.max_output_tokens == 20
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(_prompt(engine)), 5)
    assert r.usage.total_tokens == r.usage.input_tokens + 5
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    Response.model_validate(r.model_dump())  # strict: every field the client's model requires
    assert _prompt(engine) == "<system>Be brief.<user>hi</><assistant>"
    sp = engine.requests[0].sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p) == (20, 0.0, 0.5)
    with client.responses.stream(model="m", input="hi", temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello" and deltas == ["Hel", "lo"]
    assert final.usage.output_tokens == 5


def test_event_sequence_of_a_text_answer() -> None:
    api, _ = _api(["Hel", "lo"])
    events = _events(api, input="hi")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    created, done, completed = events[0]["response"], events[-2]["item"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == completed["id"]
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"
    assert events[6]["text"] == "Hello" and done["status"] == "completed" and completed["output"] == [done]
    assert completed["status"] == "completed" and completed["usage"]["output_tokens"] == 5


def test_length_cut_is_incomplete_whole_and_streamed() -> None:
    api, _ = _api(["Hel", "lo"], ["Hel", "lo"], reason="length")
    r = _client(api).responses.create(model="m", input="hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == "Hello"
    completed = _events(api, input="hi", max_output_tokens=5)[-1]
    assert completed["type"] == "response.completed" and completed["response"]["status"] == "incomplete"
    assert completed["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("step", [3, 1000])
def test_reasoning_message_and_tool_call_items(step: int) -> None:
    text = f"<think>Let me see</think>Calling.{CALL}"
    api, _ = _api(_pieces(text, step), _pieces(text, step))
    whole = _client(api).responses.create(model="m", input="Weather in Oslo?", tools=[TOOL])
    assert [i.type for i in whole.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole.output
    assert reasoning.content[0].text == "Let me see" and reasoning.id.startswith("rs_")
    assert message.content[0].text == "Calling."
    assert (call.name, call.arguments, call.status) == ("get_weather", '{"city": "Oslo"}', "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    events = _events(api, input="Weather in Oslo?", tools=[TOOL])
    kinds = [e["type"] for e in events]
    firsts = [kinds.index(k) for k in ("response.reasoning_text.delta", "response.output_text.delta",
                                       "response.function_call_arguments.delta")]  # fmt: skip
    assert firsts == sorted(firsts)
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["status"]) for i in final] == [(i.type, i.status) for i in whole.output]
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == final[2]["arguments"] == '{"city": "Oslo"}'
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [i["id"] for i in added] == [i["id"] for i in final]


def test_forced_tool_calls_required_and_named() -> None:
    api, engine = _api(['[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'], ['{"city": "Rome"}'])
    client = _client(api)
    r = client.responses.create(model="m", input="Weather?", tools=[TOOL], tool_choice="required")
    assert [(i.type, i.name, i.arguments) for i in r.output] == [("function_call", "get_weather", '{"city": "Oslo"}')]
    assert engine.requests[0].sampling_params.structured.kind == "json"
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather"
    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model="m", input="Weather?", tools=[TOOL], tool_choice=named) as stream:
        args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert args == '{"city": "Rome"}' and final.output[0].name == "get_weather"
    assert json.loads(engine.requests[1].sampling_params.structured.spec)["required"] == ["city"]


class City(BaseModel):
    name: str


def test_text_format_json_schema_parses_with_the_official_client() -> None:
    api, engine = _api(['{"name": "Oslo"}'], ["{}"])
    r = _client(api).responses.parse(model="m", input="A city?", text_format=City)
    assert r.output_parsed == City(name="Oslo")
    spec = engine.requests[0].sampling_params.structured
    assert spec.kind == "json" and json.loads(spec.spec)["properties"]["name"]["type"] == "string"
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"
    r = _client(api).responses.create(model="m", input="JSON?", text={"format": {"type": "json_object"}})
    assert engine.requests[1].sampling_params.structured.kind == "json_object" and r.output_text == "{}"


# ---- the store and chaining -------------------------------------------------------------------------------
def test_store_retrieve_delete_and_stateless_default() -> None:
    api, _ = _api(["Sunny."], ["Rain."])
    client = _client(api)
    kept = client.responses.create(model="m", input="hi", store=True)
    assert client.responses.retrieve(kept.id).output_text == "Sunny."
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    not_kept = client.responses.create(model="m", input="hi")
    assert not_kept.store is False and len(api.store) == 0
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
        client.responses.create(model="m", input="hi", previous_response_id=not_kept.id)


def test_previous_response_id_chains_messages_and_tool_calls() -> None:
    api, engine = _api(['{"city": "Oslo"}'], ["It is sunny."], ["Yes."])
    client = _client(api)
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model="m", input="Weather in Oslo?", instructions="Be brief.", tools=[TOOL],
                                    tool_choice=named, store=True)  # fmt: skip
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    second = client.responses.create(model="m", input=[result], previous_response_id=first.id, store=True)
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    assert _prompt(engine, 1) == ('<user>Weather in Oslo?<assistant>[get_weather({"city": "Oslo"})]'
                                  "<tool>Sunny, 24 C</><assistant>")  # instructions are not carried over
    client.responses.create(model="m", input="Sure?", previous_response_id=second.id, instructions="Hi.")
    assert _prompt(engine, 2).startswith("<system>Hi.<user>Weather in Oslo?<assistant>[get_weather(")
    assert _prompt(engine, 2).endswith("<tool>Sunny, 24 C<assistant>It is sunny.<user>Sure?</><assistant>")


def test_streamed_response_is_stored_when_asked() -> None:
    api, engine = _api(["Hi", "!"], ["Ok"])
    resp_id = _events(api, input="hello", store=True)[-1]["response"]["id"]
    assert _client(api).responses.retrieve(resp_id).output_text == "Hi!"
    _events(api, input="again", previous_response_id=resp_id)
    assert _prompt(engine, 1) == "<user>hello<assistant>Hi!<user>again</><assistant>"


def test_a_streamed_response_is_stored_before_its_completed_event() -> None:
    """A client that reads ``response.completed`` and then GETs the response (or chains on it) finds it."""
    store = InMemoryResponses()
    api, _ = _api(["Hi", "!"], store=store)

    async def kept_at_each_event() -> list[tuple[str, int]]:
        lines = await api.create(ResponsesRequest(stream=True, input="hello", store=True))
        return [(line.split("\n")[0].removeprefix("event: "), len(store)) async for line in lines]  # type: ignore[union-attr]

    seen = asyncio.run(kept_at_each_event())
    assert seen[-1] == ("response.completed", 1) and {n for _, n in seen[:-1]} == {0}


# ---- translation and refusals -----------------------------------------------------------------------------
def test_input_items_as_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
    ]  # fmt: skip
    req = ResponsesRequest(input=items, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                           max_output_tokens=7, seed=3, text={"format": {"type": "json_schema", "name": "x",
                                                                         "schema": {"type": "object"}}})  # fmt: skip
    chat = chat_request(req, req.input, 0)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1", "name": "get_weather"},
    ]  # fmt: skip
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == TOOL["parameters"]
    assert chat.tool_choice.function.name == "get_weather" and (chat.max_tokens, chat.seed) == (7, 3)
    assert chat.response_format.json_schema.json_schema == {"type": "object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [({"background": True}, "background"), ({"reasoning": {"effort": "high"}}, "reasoning"),
     ({"include": ["message.output_text.logprobs"]}, "include"), ({"truncation": "auto"}, "truncation"),
     ({"top_logprobs": 2}, "top_logprobs"), ({"conversation": "conv_1"}, "conversation"),
     ({"tools": [{"type": "web_search"}]}, "tools"), ({"tools": [TOOL], "tool_choice": {"type": "file_search"}},
                                                      "tool_choice"),
     ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
     ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content"),
     ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
     ({"max_output_tokens": 10**6}, "max_output_tokens"), ({"input": []}, "input")],
)  # fmt: skip
def test_unsupported_fields_are_400s_naming_them(body: dict[str, Any], param: str) -> None:
    api, engine = _api(["x"])
    with pytest.raises(APIError) as e:
        asyncio.run(api.create(ResponsesRequest(**{"input": "hi", **body})))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert not engine.requests


def test_harmless_values_of_refused_fields_are_accepted() -> None:
    api, _ = _api(["x"])
    body = {"reasoning": {"effort": None}, "truncation": "disabled", "service_tier": "auto", "include": [],
            "background": False, "stream_options": {"include_obfuscation": False}}  # fmt: skip
    r = asyncio.run(api.create(ResponsesRequest(input="hi", **body)))
    assert isinstance(r, ResponseObject) and r.output[0].content[0].text == "x"


def test_prompt_cache_retention_keeps_the_whole_prompt() -> None:
    api, engine = _api(["x"])
    asyncio.run(api.create(ResponsesRequest(input="hi there", prompt_cache_retention="24h")))
    (req,) = engine.requests
    assert [(r.start, r.end, r.duration_s) for r in req.retention] == [(0, len(req.prompt_token_ids), 3600.0)]
    with pytest.raises(APIError, match="prompt_cache_retention must be"):
        asyncio.run(api.create(ResponsesRequest(input="hi", prompt_cache_retention="forever")))


# ---- failures and disconnects -----------------------------------------------------------------------------
def _failing(api: ResponsesAPI, engine: Any) -> Callable[[EngineRequest], Any]:
    def script(req: EngineRequest) -> Any:
        yield [out(req.req_id, "Hel")]
        raise APIError(503, "the engine replica failed", "service_unavailable")

    return script


def test_an_error_after_the_stream_started_is_an_error_event_then_failed() -> None:
    api, engine = _api(["unused"])
    engine.script = _failing(api, engine)
    events = _events(api, input="hi")
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the engine replica failed" and events[-2]["code"] == "503"
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"


def test_closing_the_stream_before_the_first_token_releases_the_engine_request() -> None:
    """The client goes away after ``response.created`` (a chat client after the role chunk): the request is
    forgotten and its engine stream closed at once, though no token came."""
    api, engine = _api(["a", "b", "c"], ["a", "b", "c"])

    async def run(stream: Any) -> None:
        stream = await stream
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(run(api.create(ResponsesRequest(input="hi", stream=True))))
    assert engine.closed == [engine.requests[0].req_id] and not api.serving.processor.requests
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    asyncio.run(run(api.serving.chat(chat)))
    assert engine.closed[1] == engine.requests[1].req_id and not api.serving.processor.requests


def test_openapi_documents_the_responses_routes() -> None:
    pytest.importorskip("ray")
    from cbserve.cluster.ingress.deployment import api

    doc = api.openapi()
    post, one = doc["paths"]["/v1/responses"]["post"], doc["paths"]["/v1/responses/{response_id}"]
    get, delete = one["get"], one["delete"]
    ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"input", "instructions", "tools", "tool_choice", "text", "store", "previous_response_id"} <= set(
        body["properties"]) and body["required"] == ["input"]  # fmt: skip
    for op in (post, get):
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponseObject")
    assert delete["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponseDeleted")
