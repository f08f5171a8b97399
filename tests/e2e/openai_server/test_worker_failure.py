"""An engine replica's process killed mid-generation (at tensor-parallel size 1 its one rank runs in it): its
in-flight requests run on the other replica, before their first output as they are, after it as continuations of the
tokens streamed (every token once, none missing); a request that cannot be continued (presence penalty) fails with a
clear error (an error event in the stream, 503 when not streaming). Ray restarts the actor, which rebuilds its engine
while the app keeps running. Runs last in this package (it disturbs the shared deployment)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from .cases import MAX_TOKENS, PROMPTS
from .conftest import Server, wait_for

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
LONG = 200


def _long_request(server: Server, i: int) -> tuple[str, Any]:
    """A long greedy generation, streamed (i % 4 in 0, 2) or not, with a presence penalty (i % 4 in 2, 3: it cannot be
    continued elsewhere) or without; ("ok", completion tokens) or ("error", exception)."""
    client = server.main.client()
    kw: dict[str, Any] = dict(
        model=server.main.model, prompt=f"Story {i}:", max_tokens=LONG, temperature=0,
        presence_penalty=0.5 if i % 4 >= 2 else 0.0, extra_body={"ignore_eos": True},
    )
    try:
        if i % 2 == 0:
            chunks = client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
            return "ok", [c.usage.completion_tokens for c in chunks if c.usage is not None][0]
        return "ok", client.completions.create(**kw).usage.completion_tokens
    except openai.APIError as e:
        return "error", e


def test_killed_engine_process_continues_or_fails_in_flight_requests_and_replica_recovers(server: Server) -> None:
    from cbserve.cluster.ops.names import NAMESPACE, engine_actor_names

    app = server.main
    names = engine_actor_names("main")
    assert len(names) == 2, names  # one ingress replica, two engine replicas
    engine = ray.get_actor(names[0], namespace=NAMESPACE)
    assert ray.get(engine.worker_handles.remote()) == []  # its one rank runs in the actor
    stats = app.stats()["0"]
    generation, (pid,) = stats["generation"], stats["engine_pids"]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_long_request, server, i) for i in range(8)]  # 4 continuable, 4 not
        wait_for("requests running on replica 0", lambda: app.stats()["0"]["num_in_flight"] >= 2, 60, 0.1)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
    for i, (kind, got) in enumerate(results):
        if i % 4 < 2:  # continued where it stopped: every token once
            assert (kind, got) == ("ok", LONG), (i, got)
        elif kind == "error":  # a penalty counts output tokens: not continued, the error as before
            assert "restarting" in str(got) or "unavailable" in str(got), got
            if isinstance(got, openai.APIStatusError):  # non-streaming: the status says "retry later"
                assert got.status_code == 503
        else:
            assert got == LONG

    wait_for("replica 0 restarted", lambda: app.stats()["0"]["generation"] > generation and app.healthy(), 240)
    assert app.stats()["0"]["engine_pids"] != [pid]
    before = app.stats()["0"]["routed_requests"]
    client = app.client()
    for _ in range(4):  # round-robin between idle replicas: replica 0 gets some
        r = client.completions.create(model=app.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == server.expected[f"main:{PROMPTS[0]}"]
    assert app.stats()["0"]["routed_requests"] > before


def test_engine_lost_while_idle_is_noticed_without_a_request(server: Server) -> None:
    """An idle replica whose process dies is noticed at once (the ingress's channel to it ends) and comes back,
    instead of staying "ready" until the next request routed to it fails."""
    app = server.main
    wait_for("every replica ready", app.healthy, 240)
    stats = app.stats()["0"]
    assert stats["num_in_flight"] == 0
    generation, routed = stats["generation"], stats["routed_requests"]
    os.kill(stats["engine_pids"][0], signal.SIGKILL)
    wait_for("replica 0 back while idle", lambda: app.stats()["0"]["generation"] > generation and app.healthy(),
             240)
    assert app.stats()["0"]["routed_requests"] == routed  # no request was needed to notice
