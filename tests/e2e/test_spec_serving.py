"""Speculative decoding through the HTTP server: a real local Ray cluster runs the cbserve app with an n-gram
``speculative_config`` (bundled SmolLM2 on CPU). Greedy streamed chat and completion outputs on
input-grounded prompts equal, token for token, the offline ``LLM``'s without speculation; drafts were
proposed and accepted (the replica's /stats totals); beam search is refused with HTTP 400 naming why."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_lib import local_serve_app

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
ENGINE = {"max_model_len": 384, "max_num_batched_tokens": 384}
TEXT = "Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly. Pack my box with five jugs."
CHAT = [{"role": "user", "content": f"Repeat this text exactly: {TEXT}"}]
PROMPT = f"Rewrite the following text exactly.\nText: {TEXT}\nRewritten text: {TEXT[:30]}"


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy outputs of the offline LLM without speculation (run before Ray starts: no shared cores)."""
    from cbserve import LLM, SamplingParams

    llm = LLM(progress=False, **ENGINE)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=40)
        chat = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0]
        comp = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
        return {"chat": chat.text, "completion": comp.text, "chat_ids": chat.token_ids}  # type: ignore[dict-item]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def app_url(reference: dict) -> Iterator[str]:
    args = {"device": "cpu", "worker_torch_threads": 1, "speculative_config": json.dumps(SPEC), **ENGINE}
    with local_serve_app(args, "cbserve-spec") as url:
        yield url


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _totals(url: str) -> dict[str, float]:
    """The replicas' speculative-decoding totals, summed, from /stats (every ``spec_*`` number in it)."""
    with urllib.request.urlopen(url + "/stats", timeout=30) as r:
        stats = json.loads(r.read())
    totals: dict[str, float] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key.startswith("spec_") and isinstance(value, (int, float)):
                    totals[key] = totals.get(key, 0) + value
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(stats)
    return totals


def test_streamed_greedy_outputs_equal_those_without_speculation(app_url: str, reference: dict) -> None:
    client = _client(app_url)
    parts = []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0.0,
                                                stream=True):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == reference["chat"]
    assert len(parts) > 1  # streamed in pieces
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.0, stream=True)
        if c.choices
    )
    assert text == reference["completion"]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0.0)
    assert out.choices[0].message.content == reference["chat"]
    assert out.usage.completion_tokens == len(reference["chat_ids"])
    totals = _totals(app_url)
    assert totals.get("spec_num_draft_tokens", 0) > 0, totals
    assert 0 < totals.get("spec_num_accepted_tokens", 0) <= totals["spec_num_draft_tokens"], totals


def test_beam_search_is_refused_with_400(app_url: str) -> None:
    client = _client(app_url)
    with pytest.raises(openai.BadRequestError, match="beam search does not combine with speculative decoding"):
        client.completions.create(model=MODEL, prompt="hello", n=2, max_tokens=8, temperature=0.0,
                                  extra_body={"use_beam_search": True})  # fmt: skip
