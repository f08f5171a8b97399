"""Structured output after the reasoning, and the OpenAI Agents SDK, through real clients against a served app of
``think_model.py``'s tiny Qwen3 (called from ``test_structured_output.py``, whose module-scoped server it shares).
Greedy, the model thinks "Let me think" (text a JSON grammar forbids: JSON opens with ``{``) and closes its
reasoning, then answers "It is sunny." where nothing holds it; a grammar must leave the reasoning alone and hold
the answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest
from think_model import ANSWER, REASONING

VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
           "additionalProperties": False}  # fmt: skip
ASK = [{"role": "user", "content": "Is the sky blue?"}]


def _verdict(text: str | None) -> None:
    assert text is not None and set(json.loads(text)) == {"verdict"} and json.loads(text)["verdict"] in ("yes", "no")


def check_json_schema_after_reasoning(client: Any, model: str) -> None:
    """``response_format`` json_schema with reasoning on: ``reasoning_content`` is the free reasoning, ``content``
    JSON of the schema, whole and streamed; ``max_tokens`` counts both; thinking off, JSON from the first token."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
    kw = dict(model=model, messages=ASK, response_format=fmt, temperature=0, max_tokens=40)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.reasoning_content == msg.reasoning == REASONING and r.choices[0].finish_reason == "stop", msg
    _verdict(msg.content)
    got = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for key in got:
                got[key] += getattr(c.delta, key, None) or ""
    assert got == {"reasoning_content": REASONING, "content": msg.content}
    # "<think>Let me think</think>" are 5 tokens: a sixth is the answer's first, and the last one allowed
    cut = client.chat.completions.create(**dict(kw, max_tokens=6))
    part = cut.choices[0].message
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 6
    assert part.reasoning_content == REASONING and part.content and msg.content.startswith(part.content)
    off = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    _verdict(off.choices[0].message.content)


def check_forced_tool_call_after_reasoning(client: Any, model: str) -> None:
    """A named tool choice (chat) and ``text.format`` (Responses) hold the answer after the reasoning."""
    tool = {"type": "function", "function": {"name": "answer", "parameters": VERDICT}}
    r = client.chat.completions.create(model=model, messages=ASK, tools=[tool], temperature=0, max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "answer"}})  # fmt: skip
    msg = r.choices[0].message
    assert msg.reasoning_content == REASONING and msg.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in msg.tool_calls] == ["answer"]
    _verdict(msg.tool_calls[0].function.arguments)
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}
    resp = client.responses.create(model=model, input="Is the sky blue?", text=fmt, temperature=0, max_output_tokens=40)
    [reasoning] = [item for item in resp.output if item.type == "reasoning"]
    assert [part.text for part in reasoning.content] == [REASONING]
    _verdict(resp.output_text)


def check_agents_sdk_tool_call(base_url: str, model: str) -> None:
    """An Agents SDK ``Agent`` with one function tool over ``/v1/responses``: the first turn must call the tool
    (``tool_choice`` required: its arguments forced by the server's grammar, after the model's reasoning), the
    SDK runs it and sends its output back, and the next turn (``tool_choice`` reset to auto) is the answer."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: Literal[1, 2, 3]) -> str:
        """Current weather of a city for some days."""
        calls.append((city, days))
        return "Sunny, 24 C"

    async def run() -> Any:
        client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
        settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False)
        agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                             model_settings=settings)  # fmt: skip
        try:
            return await agents.Runner.run(agent, "Weather in Rome for 2 days?", max_turns=3,
                                           run_config=agents.RunConfig(tracing_disabled=True))  # fmt: skip
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0][0] in ("Paris", "Rome") and calls[0][1] in (1, 2, 3), calls
    kinds = [item.type for item in result.new_items]
    assert kinds == ["reasoning_item", "tool_call_item", "tool_call_output_item", "reasoning_item",
                     "message_output_item"], kinds  # fmt: skip
    assert result.final_output == ANSWER, result.final_output  # the model's free answer after its reasoning
    assert len(result.raw_responses) == 2 and result.raw_responses[0].output[-1].type == "function_call"
