"""Tensor parallelism over two worker actors (gloo on CPU) over a Ray compiled graph, echo with logprobs on it, and
the bounded waiting queue (429). The ``tp2`` app is deployed for this module only (conftest.py's ``tp2``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .cases import MAX_TOKENS, PROMPTS
from .conftest import App, Server, wait_for

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tp2_greedy_equals_tp1_offline(server: Server, tp2: App, prompt: str) -> None:
    r = tp2.client().completions.create(model=tp2.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == server.expected[f"tp2:{prompt}"]


def test_tp2_runs_over_compiled_graph(tp2: App) -> None:
    stats = tp2.stats()["0"]
    assert stats["compiled_graph"] is True and stats["dispatch_calls"] > 0
    assert stats["dispatch_overhead_ms_mean"] > 0


def test_echo_logprobs_on_the_tensor_parallel_app(tp2: App) -> None:
    """Both ranks run the LM head over the prompt rows (it gathers the vocabulary): no hang, real values."""
    r = tp2.client().completions.create(model=tp2.model, prompt=PROMPTS[0], max_tokens=1, echo=True, logprobs=1,
                                        temperature=0)  # fmt: skip
    lps = r.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == r.usage.prompt_tokens + 1 and all(v <= 0 for v in lps[1:])


def test_queue_full_gives_429_then_recovers(server: Server, tp2: App) -> None:
    app = tp2
    client = app.client()
    model = app.model
    running = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(running))  # running: it holds the only sequence slot (max_num_seqs=1)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.completions.create, model=model, prompt="Hi", max_tokens=2, temperature=0)
        wait_for("a second request waiting", lambda: app.stats()["0"]["num_in_flight"] >= 2, 30, 0.05)
        with pytest.raises(openai.RateLimitError) as info:  # the waiting queue (max_waiting=1) is full
            client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
        assert info.value.status_code == 429
        assert set(info.value.body) == {"message", "type", "param", "code"}
        status, body = app.http("POST", "/v1/completions", {"model": model, "prompt": "Hey", "stream": True})
        assert status == 429 and body["error"]["code"] == 429  # streaming requests too, before any byte
        running.close()
        assert waiting.result(timeout=120).choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == server.expected[f"tp2:{PROMPTS[0]}"]
