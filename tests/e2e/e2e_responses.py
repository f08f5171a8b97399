"""The Responses API through real clients against a served app (called from ``test_structured_output.py``, whose
module-scoped server it shares): the official ``openai`` client's ``responses.create`` and ``responses.stream``,
a forced tool call answered through ``previous_response_id``, and LangChain's ``ChatOpenAI`` with
``use_responses_api=True`` making a tool call."""

from __future__ import annotations

import json
from typing import Any

import pytest

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False},
}  # fmt: skip


def check_text_whole_and_streamed(client: Any, model: str) -> None:
    kw = dict(model=model, input="Say hello to Ann.", instructions="Be brief.", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status in ("completed", "incomplete") and whole.output_text, whole
    assert whole.id.startswith("resp_") and whole.usage.output_tokens <= 8
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text and len(deltas) > 1


def check_forced_tool_call_and_its_answer(client: Any, model: str) -> None:
    first = client.responses.create(model=model, input="What is the weather in Paris for the next 3 days?",
                                    tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=80, temperature=0, store=True)  # fmt: skip
    [call] = [item for item in first.output if item.type == "function_call"]
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and set(args) == {"city", "days"} and 1 <= args["days"] <= 7, call
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    second = client.responses.create(model=model, input=[result], previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=4, temperature=0)  # fmt: skip
    assert second.output[0].type == "message" and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id


def check_langchain_tool_call(base_url: str, model: str) -> None:
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, days: int) -> str:
        """Current weather of a city for some days."""
        return "sunny"

    llm = lc.ChatOpenAI(base_url=base_url, api_key="none", model=model, temperature=0, max_tokens=80, max_retries=0,
                        use_responses_api=True)  # fmt: skip
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome for 2 days?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
    assert set(msg.tool_calls[0]["args"]) == {"city", "days"}
