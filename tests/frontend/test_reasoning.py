"""Reasoning parsers (``frontend/tools/reasoning.py``): the split into reasoning and answer, whole and streamed in
pieces cut anywhere (inside the tags too), chosen per request from the prompt and ``chat_template_kwargs``;
the chat flow's answers and SSE chunks with reasoning and tool calls from the answer only; forced tool calls
cut short by ``max_tokens``; JSON with or without any whitespace (``disable_any_whitespace``). Over the
scripted engine (no model, no Ray)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from frontend_fakes import EOS, CharTokenizer, ScriptedEngine, out

from cbserve.frontend.protocol import APIError, ChatCompletionRequest
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.tools.calls import final_message
from cbserve.frontend.tools.reasoning import (
    ReasoningMode,
    ReasoningStream,
    parser_for_template,
    request_mode,
    resolve_reasoning_parser,
    split_reasoning,
)
from cbserve.frontend.tools.structured import ToolMode
from cbserve.frontend.validation import ServedModel
from cbserve.scheduler.requests.request import EngineRequest

QWEN3, R1 = ReasoningMode(inside=False), ReasoningMode(inside=True)
CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


def _streamed(mode: ReasoningMode, pieces: list[str]) -> tuple[str, str]:
    s = ReasoningStream(mode)
    reasoning = content = ""
    for k, piece in enumerate(pieces):
        r, c = s.feed(piece, final=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(
    ("mode", "text", "want"),
    [
        (QWEN3, "<think>\nHmm, Paris.\n</think>\n\nIt is sunny.", ("\nHmm, Paris.\n", "\n\nIt is sunny.")),
        (QWEN3, "It is sunny, no <think> here.", (None, "It is sunny, no <think> here.")),
        (QWEN3, "<think>still thinking when max_tokens hit </thi", ("still thinking when max_tokens hit </thi", None)),
        (QWEN3, "<think></think>answer", (None, "answer")),
        (QWEN3, "<thin", (None, "<thin")),
        (QWEN3, "", (None, "")),
        (R1, "Let me see.</think>The answer is 4.", ("Let me see.", "The answer is 4.")),
        (R1, "<think>Let me see.</think>4", ("Let me see.", "4")),
        (R1, "no end tag: all reasoning", ("no end tag: all reasoning", None)),
        (R1, "</think>", (None, None)),
    ],
)  # fmt: skip
def test_split_whole_and_streamed_at_every_cut(mode: ReasoningMode, text: str, want: tuple) -> None:
    assert split_reasoning(mode, text) == want
    whole = (want[0] or "", want[1] or "")
    for cut in range(len(text) + 1):  # two pieces, cut anywhere (inside either tag too)
        assert _streamed(mode, [text[:cut], text[cut:]]) == whole, cut
    for step in (1, 2, 3):
        assert _streamed(mode, [text[i : i + step] for i in range(0, len(text), step)] or [""]) == whole


def test_a_stream_holds_back_only_what_may_be_a_tag() -> None:
    s = ReasoningStream(QWEN3)
    assert s.feed("<th", final=False) == ("", "")  # may open the reasoning
    assert s.feed("ink>abc</", final=False) == ("abc", "")  # "</" may close it
    assert s.feed("b>", final=False) == ("</b>", "")
    assert s.feed("</think>ok", final=False) == ("", "ok")
    assert s.feed(" <think>", final=True) == ("", " <think>")  # the answer is never held back


def test_request_mode_from_prompt_and_template_kwargs() -> None:
    assert request_mode(None, "<think>") is None
    assert request_mode("qwen3", "<|im_start|>assistant\n") == QWEN3
    assert request_mode("qwen3", "<|im_start|>assistant\n<think>\n") == R1  # the template opened it
    assert request_mode("deepseek_r1", "<｜Assistant｜>") == R1
    assert request_mode("qwen3", "assistant\n<think>\n\n</think>\n\n") is None  # closed: thinking off
    assert request_mode("qwen3", "x", {"enable_thinking": False}) is None
    assert request_mode("deepseek_r1", "<think>\n", {"thinking": False}) is None
    assert request_mode("qwen3", "x", {"enable_thinking": True}) == QWEN3
    assert request_mode("deepseek_r1", "<think>\n", constrained=True) == QWEN3  # a grammar from the first token


QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
R1_TEMPLATE = "{{ m.content.split('</think>')[-1] }}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"


def test_parser_from_the_chat_template() -> None:
    assert parser_for_template(QWEN3_TEMPLATE) == "qwen3"
    assert parser_for_template(R1_TEMPLATE) == "deepseek_r1"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
    assert parser_for_template("{{ m.content.split('</think>') }} <think>") is None  # ambiguous: off
    assert resolve_reasoning_parser("auto", QWEN3_TEMPLATE) == "qwen3"
    assert resolve_reasoning_parser("none", QWEN3_TEMPLATE) is None and resolve_reasoning_parser(None, "") is None
    assert resolve_reasoning_parser("deepseek_r1", None) == "deepseek_r1"
    with pytest.raises(ValueError, match="reasoning_parser"):
        resolve_reasoning_parser("granite", None)


def test_config_field_and_cli_flag() -> None:
    from cbserve.config import CBServeConfig

    assert CBServeConfig(device="cpu").reasoning_parser == "none" and CBServeConfig(device="cpu").disable_any_whitespace
    cfg = CBServeConfig.from_args({"reasoning-parser": "qwen3", "disable-any-whitespace": "false"})
    assert cfg.reasoning_parser == "qwen3" and cfg.disable_any_whitespace is False
    assert CBServeConfig.from_args({"reasoning_parser": "null"}).reasoning_parser == "none"
    with pytest.raises(ValueError, match="reasoning_parser"):
        CBServeConfig(reasoning_parser="granite", device="cpu")


# ---- the chat flow -----------------------------------------------------------------------------------
class ThinkTokenizer(CharTokenizer):
    """A Hermes tool-call template that switches thinking with ``enable_thinking`` ("auto" picks qwen3);
    ``opens``: its generation prompt opens ``<think>`` (as DeepSeek-R1's does)."""

    chat_template = "<tool_call>{% if enable_thinking %}<think>{% endif %}"

    def __init__(self, opens: bool = False) -> None:
        self.opens = opens

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool,
                            **kw: Any) -> str:  # fmt: skip
        kw.pop("tools", None)
        text = super().apply_chat_template(messages, tokenize, add_generation_prompt, **kw)
        return text + ("<think>\n" if self.opens else "")


class TagTokenizer(ThinkTokenizer):
    """``<think>`` and ``</think>`` are one token each (as in Qwen3's and DeepSeek-R1's vocabularies)."""

    TAGS = {"<think>": 0x2000, "</think>": 0x2001}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in self.TAGS if text.startswith(t, i)), None)
            ids.append(self.TAGS[tag] if tag else ord(text[i]))
            i += len(tag) if tag else 1
        return {"input_ids": ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        names, plain = {v: k for k, v in self.TAGS.items()}, super().decode
        return "".join(names.get(i) or plain([i], skip_special_tokens) for i in ids)


def _chat(pieces: list[str], stream: bool, reason: str = "stop", opens: bool = False, served: dict | None = None,
          tags: bool = False, **kw: Any) -> tuple[Any, ScriptedEngine]:  # fmt: skip
    def script(req: EngineRequest) -> list[list[Any]]:
        last = len(pieces) - 1
        return [[out(req.req_id, p, finished=i == last, reason=reason)] for i, p in enumerate(pieces)]

    engine = ScriptedEngine(script)
    model = ServedModel("m", 4096, 4, 0x3000, **{"reasoning_parser": "auto", **(served or {})})
    serving = OpenAIServing(model, (TagTokenizer if tags else ThinkTokenizer)(opens), engine, [EOS])
    serving.grammars.check = lambda spec, param: None  # the character tokenizer has no xgrammar vocabulary
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=stream, **kw)

    async def run() -> Any:
        r = await serving.chat(req)
        return [json.loads(line[6:]) for line in [x async for x in r] if line[6:].strip() != "[DONE]"] if stream else r

    return asyncio.run(run()), engine


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def _pieces(text: str, step: int) -> list[str]:
    return [text[i : i + step] for i in range(0, len(text), step)]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_chat_splits_reasoning_and_parses_tool_calls_from_the_answer_only(step: int) -> None:
    text = f"<think>I could write {CALL} but</think>Calling.{CALL}"
    r, _ = _chat(_pieces(text, step), stream=False, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.reasoning_content == msg.reasoning == f"I could write {CALL} but"
    assert msg.content == "Calling." and [c.function.name for c in msg.tool_calls] == ["f"]
    assert r.choices[0].finish_reason == "tool_calls"
    body = r.model_dump()["choices"][0]["message"]
    assert body["reasoning_content"] == msg.reasoning_content
    chunks, _ = _chat(_pieces(text, step), stream=True, tools=[WEATHER])
    assert _joined(chunks, "reasoning_content") == _joined(chunks, "reasoning") == msg.reasoning_content
    assert _joined(chunks, "content") == "Calling."
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "f" and len({tc["index"] for tc in calls}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # every reasoning piece comes before the first content piece
    kinds = [k for c in chunks for k in ("reasoning_content", "content") if c["choices"][0]["delta"].get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")


def test_prompt_that_opens_thinking_and_thinking_turned_off() -> None:
    r, _ = _chat(["Hmm", ".</th", "ink>4"], stream=False, opens=True)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Hmm.", "4")
    r, engine = _chat(["<think>a</think>b"], stream=False, chat_template_kwargs={"enable_thinking": False})
    assert "[enable_thinking=False]" in "".join(chr(t) for t in engine.requests[0].prompt_token_ids)
    msg = r.choices[0].message
    assert msg.content == "<think>a</think>b" and msg.reasoning_content is None
    assert "reasoning_content" not in r.model_dump()["choices"][0]["message"]  # no parser, no field
    r, _ = _chat(["<think>a</think>b"], stream=False, served={"reasoning_parser": None})
    assert r.choices[0].message.content == "<think>a</think>b"


def test_reasoning_cut_by_max_tokens_has_no_content() -> None:
    r, _ = _chat(["<think>long ", "thought"], stream=False, reason="length")
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("long thought", None, "length")
    chunks, _ = _chat(["<think>long ", "thought"], stream=True, reason="length")
    assert _joined(chunks, "reasoning_content") == "long thought" and _joined(chunks, "content") == ""


def test_reasoning_effort_is_refused() -> None:
    with pytest.raises(APIError, match="reasoning_effort .*enable_thinking"):
        _chat(["x"], stream=False, reasoning_effort="low")


# ---- forced tool calls cut short ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "text", "args"),
    [
        (ToolMode("named", "get_weather"), '{"city": "Paris Paris  }', '{"city": "Paris Paris  }'),
        (ToolMode("named", "get_weather"), "{", "{"),
        (ToolMode("required"), '[{"name": "get_weather", "parameters": {"city": "Par}', '{"city": "Par}'),
    ],
)
def test_forced_call_cut_short_is_still_a_call(mode: ToolMode, text: str, args: str) -> None:
    content, calls = final_message(mode, text)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", args)]
    if mode.format == "required":  # cut in a later call: the complete ones are the answer
        content, calls = final_message(mode, text.replace("[", '[{"name": "f", "parameters": {"a": 1}}, ', 1))
        assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"a": 1}')]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call_that_hits_max_tokens(tool_choice: Any) -> None:
    text = '{"city": "Paris Paris Pa' if tool_choice != "required" else '[{"name": "get_weather", "parameters": {"ci'
    args = text if tool_choice != "required" else '{"ci'
    r, engine = _chat(_pieces(text, 3), stream=False, reason="length", tools=[WEATHER], tool_choice=tool_choice)
    assert engine.requests[0].sampling_params.structured is not None
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_weather", args)]
    chunks, _ = _chat(_pieces(text, 3), stream=True, reason="length", tools=[WEATHER], tool_choice=tool_choice)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"].get("arguments", "") for tc in calls) == args  # nothing held back at the end
    assert _joined(chunks, "content") == "" and chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- JSON whitespace ------------------------------------------------------------------------------
def test_disable_any_whitespace_from_server_and_request() -> None:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fixed, spaced = '{"a": 1}', '{\n  "a" :  1\n}'
    compact = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    assert accepts(compact, fixed) and not accepts(compact, spaced)  # how the workers compile a json spec

    def sent(served: dict, **so: Any) -> Any:
        _, engine = _chat(["{}"], stream=False, served=served, structured_outputs={"json": schema, **so})
        return engine.requests[0].sampling_params.structured

    assert sent({}).kind == "json"  # the server's default: one fixed layout
    assert sent({"disable_any_whitespace": False}, disable_any_whitespace=True).kind == "json"
    for spec in (sent({"disable_any_whitespace": False}), sent({}, disable_any_whitespace=False)):
        assert spec.kind == "grammar"
        grammar = xgr.Grammar.from_ebnf(spec.spec)
        assert accepts(grammar, spaced) and accepts(grammar, fixed) and not accepts(grammar, '{"a": "x"}')
    with pytest.raises(APIError, match="invalid json"):
        sent({}, disable_any_whitespace=False, json='{"type": "objekt"}')


# ---- structured output after the reasoning ---------------------------------------------------------------
SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("opens", "served", "kwargs", "gate"),
    [(False, {}, None, (0x2000, 0x2001)),  # qwen3: the output may open <think>, or answer at once
     (True, {}, None, (None, 0x2001)),  # the prompt opened it (deepseek_r1's case)
     (False, {}, {"enable_thinking": False}, None),  # thinking off: the grammar from the first token
     (False, {"reasoning_parser": None}, None, None)],
)  # fmt: skip
def test_a_reasoning_request_sends_its_grammar_gated(opens: bool, served: dict, kwargs: Any, gate: Any) -> None:
    r, engine = _chat(["<think>a { b</think>", '{"x": 1}'], stream=False, opens=opens, served=served, tags=True,
                      response_format=SCHEMA, chat_template_kwargs=kwargs)  # fmt: skip
    spec = engine.requests[0].sampling_params.structured
    sent = None if spec.reasoning_end is None else (spec.reasoning_start, spec.reasoning_end)
    assert spec.kind == "json" and sent == gate
    msg = r.choices[0].message
    if served or kwargs:
        assert msg.content == '<think>a { b</think>{"x": 1}' and msg.reasoning_content is None
    else:
        assert (msg.reasoning_content, msg.content) == ("a { b", '{"x": 1}')


def test_tags_of_several_tokens_keep_the_grammar_from_the_first_token() -> None:
    _, engine = _chat(["{}"], stream=False, opens=True, response_format=SCHEMA)
    spec = engine.requests[0].sampling_params.structured
    assert spec.reasoning_start is None and spec.reasoning_end is None
    r, _ = _chat(["Hmm</think>{}"], stream=False, opens=True, response_format=SCHEMA)  # held from its first token,
    assert r.choices[0].message.content == "Hmm</think>{}"  # the output is the answer though the prompt opened <think>


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_after_the_reasoning(stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    text = '<think>They want {"city"} maybe</think>{"city": "Paris"}'
    r, engine = _chat(_pieces(text, 5), stream=stream, tags=True, tools=[WEATHER], tool_choice=named)
    assert engine.requests[0].sampling_params.structured.reasoning_end == 0x2001
    if stream:
        assert _joined(r, "reasoning_content") == 'They want {"city"} maybe' and _joined(r, "content") == ""
        calls = [tc for c in r for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        assert "".join(tc["function"].get("arguments", "") for tc in calls) == '{"city": "Paris"}'
        assert r[-1]["choices"][0]["finish_reason"] == "tool_calls"
        return
    msg = r.choices[0].message
    assert msg.reasoning_content == 'They want {"city"} maybe' and msg.content is None
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
