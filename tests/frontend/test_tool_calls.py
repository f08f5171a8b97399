"""Tool calls read from model-like text: each format whole and streamed piece by piece (the streamed
pieces add up to the whole answer), and the chat flow's answers and SSE chunks with tool calls, over the
scripted engine (no model, no Ray)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from frontend_fakes import EOS, CharTokenizer, ScriptedEngine, out

from cbserve.frontend.protocol import APIError, ChatCompletionRequest
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.tools.calls import ToolCallStream, final_message
from cbserve.frontend.tools.parsers import parse_tool_calls, parser_for_template
from cbserve.frontend.tools.structured import ToolMode, required_calls_schema, resolve_tool_parser, tool_setup
from cbserve.frontend.validation import ServedModel, template_message
from cbserve.scheduler.requests.request import EngineRequest

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": {"c": true}}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {"tz": "}"}}]'
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]  # fmt: skip


def _stream(mode: ToolMode, text: str, step: int) -> tuple[str, dict[int, dict[str, Any]], int]:
    """Feed ``text`` in pieces of ``step`` characters; returns content, calls (name, id, arguments)."""
    s = ToolCallStream(mode)
    content, calls, num_deltas = "", {}, 0
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        c, deltas = s.feed(piece, final=k == len(pieces) - 1)
        content += c or ""
        for d in deltas:
            num_deltas += 1
            call = calls.setdefault(d.index, {"name": None, "id": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None and d.id.startswith("call_") and d.function.name  # first delta
                call["id"], call["name"] = d.id, d.function.name
            else:
                assert d.function.name is None
            call["arguments"] += d.function.arguments or ""
    return content, calls, num_deltas


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize(
    ("mode", "text", "want_content", "want"),
    [
        (ToolMode("hermes"), HERMES, "Let me check.",
         [("get_weather", {"city": "Paris", "unit": {"c": True}}), ("get_time", {"tz": "CET"})]),
        (ToolMode("llama3_json"), LLAMA, None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        (ToolMode("required"), REQUIRED, None, [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "}"})]),
        (ToolMode("named", "get_weather"), '{"city": {"x": "}}"}}', None, [("get_weather", {"city": {"x": "}}"}})]),
        (ToolMode("hermes", parallel=False), HERMES, "Let me check.",
         [("get_weather", {"city": "Paris", "unit": {"c": True}})]),
    ],
)  # fmt: skip
def test_tool_calls_whole_and_streamed(
    mode: ToolMode, text: str, want_content: str | None, want: list, step: int
) -> None:
    content, calls = final_message(mode, text)
    assert content == want_content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    s_content, s_calls, num_deltas = _stream(mode, text, step)
    assert [(c["name"], json.loads(c["arguments"])) for c in s_calls.values()] == want
    assert [c.function.arguments for c in calls] == [c["arguments"] for c in s_calls.values()]  # same raw text
    assert s_content.strip() == (want_content or "")
    if step == 1:
        assert num_deltas > 2 * len(want)  # the arguments really came in pieces


@pytest.mark.parametrize(
    ("mode", "text"),
    [(ToolMode("hermes"), "Just an answer, no <tool call here."), (ToolMode("llama3_json"), "Paris is sunny."),
     (ToolMode("hermes"), '<tool_call>{"name": "f", "arguments": {"a": '), (ToolMode("llama3_json"), "{not json")],
)  # fmt: skip
def test_text_without_complete_calls_is_content(mode: ToolMode, text: str) -> None:
    content, calls = final_message(mode, text)
    assert content == text and calls == []
    s_content, s_calls, _ = _stream(mode, text, 2)
    assert not any(c["name"] for c in s_calls.values()) or mode.format == "hermes"
    if not s_calls:
        assert s_content == text


def test_parser_chosen_from_the_chat_template() -> None:
    assert parser_for_template("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}") == "hermes"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None
    assert resolve_tool_parser("auto", "<tool_call>") == "hermes"
    assert resolve_tool_parser("llama3_json", None) == "llama3_json"
    assert resolve_tool_parser("none", "<tool_call>") is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        resolve_tool_parser("mistral", None)
    assert parse_tool_calls("hermes", "abc<tool_", final=False).content == "abc"  # a tag may be starting


def test_tool_setup_and_required_schema() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False)  # fmt: skip
    tools, mode, spec = tool_setup(req, None)
    assert tools[0]["function"]["name"] == "get_weather" and mode == ToolMode("required", parallel=False)
    schema = json.loads(spec.spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert required_calls_schema([req.tools[1]], True)["items"]["properties"]["parameters"] == {"type": "object"}
    named = ChatCompletionRequest.model_validate(
        {**req.model_dump(exclude_none=True), "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    _, mode, spec = tool_setup(named, None)
    assert mode.format == "named" and json.loads(spec.spec)["required"] == ["city"]
    nope = {"type": "function", "function": {"name": "nope"}}
    for bad, match in [({"tool_choice": "auto"}, "tool-call parser"), ({"tools": None}, "needs tools"),
                       ({"tool_choice": nope}, "not in tools")]:  # fmt: skip
        r = ChatCompletionRequest.model_validate({**req.model_dump(exclude_none=True), **bad})
        with pytest.raises(APIError, match=match):
            tool_setup(r, None)


def test_history_messages_keep_their_tool_calls() -> None:
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])  # fmt: skip
    msgs = [template_message(m) for m in req.messages]
    assert msgs[1]["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


class ToolTokenizer(CharTokenizer):
    chat_template = "<tool_call>"

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool,
                            tools: list | None = None) -> str:  # fmt: skip
        return f"<tools>{json.dumps(tools)}" + super().apply_chat_template(messages, tokenize, add_generation_prompt)


def _chat(text_pieces: list[str], stream: bool, **kw: Any) -> tuple[Any, ScriptedEngine]:
    def script(req: EngineRequest) -> list[list[Any]]:
        last = len(text_pieces) - 1
        return [[out(req.req_id, p, finished=i == last, reason="stop")] for i, p in enumerate(text_pieces)]

    engine = ScriptedEngine(script)
    serving = OpenAIServing(ServedModel("m", 4096, 4, 0x3000), ToolTokenizer(), engine, [EOS])
    serving.grammars.check = lambda spec, param: None  # the character tokenizer has no xgrammar vocabulary
    msgs = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest(model="m", messages=msgs, tools=TOOLS, stream=stream, **kw)

    async def run() -> Any:
        r = await serving.chat(req)
        return [json.loads(line[6:]) for line in [x async for x in r] if line[6:].strip() != "[DONE]"] if stream else r

    return asyncio.run(run()), engine


def test_chat_answer_and_stream_with_auto_tool_calls() -> None:
    pieces = [HERMES[i : i + 5] for i in range(0, len(HERMES), 5)]
    r, engine = _chat(pieces, stream=False)
    prompt = "".join(chr(t) for t in engine.requests[0].prompt_token_ids)
    assert prompt.startswith("<tools>[") and '"get_time"' in prompt  # tools reached the template
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    chunks, _ = _chat(pieces, stream=True)
    deltas = [c["choices"][0] for c in chunks]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    calls = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls[1:] if tc["index"] == 0)
    args = "".join(tc["function"].get("arguments", "") for tc in calls if tc["index"] == 0)
    assert json.loads(args) == {"city": "Paris", "unit": {"c": True}}
    assert "".join(d["delta"].get("content") or "" for d in deltas).strip() == "Let me check."


def test_chat_with_forced_tool_choice_sends_a_grammar() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r, engine = _chat(['{"city": "Ro', 'me"}'], stream=False, tool_choice=named)
    spec = engine.requests[0].sampling_params.structured
    assert spec.kind == "json" and json.loads(spec.spec)["required"] == ["city"]
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"city": "Rome"}'
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    r, engine = _chat(["plain"], stream=False, tool_choice="none")
    assert engine.requests[0].sampling_params.structured is None and r.choices[0].message.content == "plain"
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_response_format_and_structured_outputs_become_one_spec() -> None:
    from cbserve.frontend.tools.structured import request_spec

    def spec_of(**kw: Any) -> Any:
        return request_spec(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw))

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec, param = spec_of(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                                  "strict": True}})  # fmt: skip
    assert (spec.kind, json.loads(spec.spec), param) == ("json", schema, "response_format")
    assert spec_of(response_format={"type": "json_object"})[0].kind == "json_object"
    assert spec_of(response_format={"type": "text"}) == (None, None) and spec_of() == (None, None)
    spec, param = spec_of(structured_outputs={"choice": ["a", "b"]})
    assert (spec.kind, json.loads(spec.spec), param) == ("choice", ["a", "b"], "structured_outputs")
    assert spec_of(structured_outputs={"regex": "[0-9]+"})[0].spec == "[0-9]+"
    assert spec_of(structured_outputs={"json": schema})[0].kind == "json"
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    for bad, match in [({"structured_outputs": {"regex": "a", "grammar": "b"}}, "exactly one"),
                       ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
                       ({"response_format": no_schema}, "schema")]:  # fmt: skip
        with pytest.raises(APIError, match=match):
            spec_of(**bad)
    with pytest.raises(ValueError, match="ignore_eos"):  # the grammar ends the output with EOS
        from cbserve.scheduler.requests.sampling_params import SamplingParams, StructuredSpec

        SamplingParams(structured=StructuredSpec("regex", "a"), ignore_eos=True)
