"""Retention hints served (scheduler/kv/retention.py): a tiny model behind the real HTTP server on a real local Ray,
one engine replica whose KV pool holds a few conversations only. A conversation asks to keep its long system prompt
(a chat message's ``cache_control`` as Anthropic's API; ``retention_directives`` as vLLM's proposal;
``prompt_cache_retention: "24h"`` as OpenAI's), a flood of other conversations without hints runs through the pool,
and the conversation's next turn still finds its prefix cached (``usage.prompt_tokens_details.cached_tokens``, the
OpenAI client's field); without the hint the flood evicts it. Hints past the server's limits are a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from e2e_lib import SharedRay

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

BLOCKS = 96  # of 16 tokens: the hinted prompts of this module fit in its half (the default share), floods do not
BASE = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "max_num_seqs": 4, "num_replicas": 1,
        "worker_num_cpus": 1, "num_kv_blocks": BLOCKS, "node_tuning": "off", "served_model_name": "tiny",
        "kv_retention_max_duration_s": 7200.0}  # fmt: skip


def _system(job: str) -> str:
    """A long system prompt of its own (two of them share no block)."""
    return f"You are the assistant of a {job}. " + " ".join(f"Rule {i}: keep {job} lamp {i} lit." for i in range(16))


@pytest.fixture(scope="module")
def client(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tiny_llama import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("retention") / "tiny")
    with shared_ray.apps({"retention": dict(BASE, model=str(folder))}, {"retention": "/"}) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client: Any, system: dict[str, Any], user: str) -> int:
    """The cached prompt tokens of one chat turn."""
    r = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                       messages=[system, {"role": "user", "content": user}])  # fmt: skip
    return r.usage.prompt_tokens_details.cached_tokens


def _flood(client: Any, tag: str) -> None:
    """Conversations without hints, many times the pool's blocks between them."""
    for i in range(10):
        other = f"You are assistant {tag}-{i}. " + " ".join(f"Fact {tag}{i}-{j}: {j * 7 + i}." for j in range(24))
        _chat(client, {"role": "system", "content": other}, "hello")


@pytest.mark.parametrize("ttl", [None, "1h"])
def test_cache_control_keeps_the_system_prompt_through_a_flood(client: Any, ttl: str | None) -> None:
    mark = {"type": "ephemeral"} | ({"ttl": ttl} if ttl else {})
    hinted = {"role": "system", "content": [{"type": "text", "text": _system(f"keeper {ttl}"), "cache_control": mark}]}
    plain = {"role": "system", "content": _system(f"harbour master {ttl}")}
    _chat(client, hinted, "first turn")
    _chat(client, plain, "first turn")
    _flood(client, f"cc{ttl}")
    kept, lost = _chat(client, hinted, "second turn"), _chat(client, plain, "second turn")
    assert kept >= 192 and lost < 64, (kept, lost)  # the system prompt is ~210 tokens of the template's ~240


def test_retention_directives_and_prompt_cache_retention_on_completions(client: Any) -> None:
    prompts = {"directive": [7 + (i % 900) for i in range(160)], "openai": [11 + (i % 800) for i in range(160)],
               "plain": [13 + (i % 700) for i in range(160)]}  # fmt: skip
    extra = {"directive": {"retention_directives": [{"start": 0, "end": 160, "priority": 90, "duration": 600}]},
             "openai": {"prompt_cache_retention": "24h"}, "plain": {}}  # fmt: skip

    def run(name: str, tail: int) -> int:
        r = client.completions.create(model="tiny", prompt=[*prompts[name], tail], max_tokens=2, temperature=0,
                                      extra_body=extra[name])  # fmt: skip
        return r.usage.prompt_tokens_details.cached_tokens

    for name in prompts:
        run(name, 1)
    _flood(client, "cmpl")
    cached = {name: run(name, 2) for name in prompts}
    assert cached["directive"] == cached["openai"] == 160 and cached["plain"] < 64, cached


@pytest.mark.parametrize(("extra", "why"), [
    ({"retention_directives": [{"start": 0, "priority": 50, "duration": 9000}]}, "within (0, 7200] seconds"),
    ({"retention_directives": [{"start": 0, "end": 999, "priority": 50}]}, "not within the prompt"),
    ({"retention_directives": [{"start": 0, "priority": 0}]}, "priority"),
    ({"prompt_cache_retention": "1w"}, "prompt_cache_retention must be"),
])
def test_hints_past_the_limits_are_a_400(client: Any, extra: dict[str, Any], why: str) -> None:
    with pytest.raises(openai.BadRequestError, match=why.replace("(", "\\(").replace("]", "\\]")):
        client.completions.create(model="tiny", prompt="hello there", max_tokens=2, extra_body=extra)


def test_a_malformed_cache_control_is_a_400(client: Any) -> None:
    bad = {"role": "system", "content": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}
    with pytest.raises(openai.BadRequestError, match="cache_control must be"):
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[bad, {"role": "user", "content": "y"}])
