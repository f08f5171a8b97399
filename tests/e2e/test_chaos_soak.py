"""Chaos soak: hundreds of streamed requests on two engine replicas while the engine process of one and then of the
other (its scheduler actor, which runs its one rank) are killed with SIGKILL. The engine is the simulated one
(``model: sim``: the whole stack, channels, routing and failover included, over steps that sleep instead of a
model), so the soak runs in seconds.

Nothing is lost that need not be: no request fails before its first token (the ingress retries it on the live
replica), no stream is cut (one that had streamed tokens ends with an SSE error event, then ``[DONE]``), none hangs;
both replicas come back (each actor restarted by Ray) and every KV block is free."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from e2e_lib import SharedRay, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]
httpx = pytest.importorskip("httpx")

MAX_TOKENS = 48
SHARED = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
ARGS = {"model": "sim", "num_replicas": 2, "max_model_len": 4096, "node_tuning": "off", "max_restarts": 4}


@pytest.fixture(scope="module")
def url(shared_ray: SharedRay) -> Iterator[str]:
    with shared_ray.apps({"chaos": ARGS}, {"chaos": "/"}) as base:
        yield base


def _stats(url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(url + "/stats", timeout=30) as r:
        return {d["replica"]: d for d in json.loads(r.read())["replicas"]}


def stream_outcome(client: Any, url: str, prompt: str) -> str:
    """One streamed completion, read as raw SSE: "complete" (every token, finish "length", [DONE]), "error after
    tokens" (an error event after some tokens, then [DONE]), "failed before first token" (an error status or
    event before any token), "cut" (the stream ended otherwise) or "hang" (no byte for 60 s)."""
    body = {"model": "sim", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, finish, error, done = 0, None, False, False
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                r.read()
                return f"failed before first token|{r.status_code} {r.text[:300]}"
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = str(event["error"])[:300]
                for choice in event.get("choices") or []:
                    tokens += bool(choice.get("text"))
                    finish = choice.get("finish_reason") or finish
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.TimeoutException:
        return "hang"
    except httpx.HTTPError:
        return "cut" if tokens else "failed before first token"
    if error:
        return (f"error after tokens|{error}" if tokens else f"failed before first token|{error}") if done else "cut"
    return "complete" if done and finish == "length" and tokens == MAX_TOKENS else "cut"


class Soak:
    """``clients`` threads streaming back to back until stopped; every outcome counted."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.outcomes, self.stop = url, Counter[str](), threading.Event()
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.details: list[str] = []  # why each request that did not complete ended
        # half the clients send one prompt (the cache-aware router gathers them on the replica caching it), half
        # prompts of their own (spread by load): both replicas are busy when they are killed
        self.threads = [threading.Thread(target=self._run, args=(i % 2 == 0,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, shared: bool) -> None:
        with httpx.Client() as client:
            while not self.stop.is_set():
                prompt = SHARED if shared else f"request {next(self.ids)} of the soak"
                outcome, _, detail = stream_outcome(client, self.url, prompt).partition("|")
                with self.lock:
                    self.outcomes[outcome] += 1
                    if detail:
                        self.details.append(f"{time.monotonic():.1f} {outcome}: {detail}")

    def count(self, outcome: str | None = None) -> int:
        with self.lock:
            return self.outcomes[outcome] if outcome else sum(self.outcomes.values())

    def end(self) -> Counter[str]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a client is stuck"
        return self.outcomes


def _idle(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    free = all(r.get("num_in_flight") == 0 and r.get("num_free_kv_blocks") == r.get("num_kv_blocks")
               for r in stats.values())  # fmt: skip
    return stats if free else None


def _rebuilt(url: str, replica: str, generation: int) -> Callable[[], bool]:
    """Whether ``replica`` serves again with a newer build (its ``generation``: counted across its actor's lives)."""

    def check() -> bool:
        s = _stats(url)[replica]
        return s.get("state") == "ready" and s["generation"] > generation

    return check


def test_sigkill_one_engine_then_the_other_loses_nothing_that_had_not_started(url: str) -> None:
    soak = Soak(url, clients=24)
    try:
        wait_for("the soak under way", lambda: soak.count("complete") >= 40, 120, 0.2)
        before = _stats(url)
        pids0, pids1 = before["0"]["engine_pids"], before["1"]["engine_pids"]
        assert len(pids0) == len(pids1) == 1  # tensor-parallel size 1: the rank runs in the engine actor
        os.kill(pids0[0], signal.SIGKILL)  # replica 0's engine
        wait_for("replica 0 restarted", _rebuilt(url, "0", before["0"]["generation"]), 180)
        assert _stats(url)["0"]["engine_pids"][0] != pids0[0]
        served = soak.count("complete")
        os.kill(pids1[0], signal.SIGKILL)  # replica 1's scheduler actor (Ray restarts it)
        wait_for("replica 1's scheduler back", lambda: (s := _stats(url)["1"]).get("state") == "ready"
                 and s["engine_pids"][0] != pids1[0], 180)  # fmt: skip
        wait_for("both replicas serving after the kills",
                 lambda: soak.count("complete") >= served + 60 and soak.count() >= 300, 180, 0.2)
    finally:
        outcomes = soak.end()
    print(f"chaos soak outcomes: {dict(outcomes)}")
    why = [d for d in soak.details if "error after tokens" not in d][:10]  # (time, outcome, the error) of each
    assert outcomes["failed before first token"] == 0, (outcomes, why)
    assert outcomes["cut"] == 0 and outcomes["hang"] == 0, (outcomes, why)
    assert outcomes["complete"] >= 250, outcomes
    stats = wait_for("every replica idle with every KV block free", lambda: _idle(_stats(url)), 60)
    assert all(r["state"] == "ready" for r in stats.values()) and len(stats) == 2
    assert stats["0"]["generation"] > before["0"]["generation"]
    assert stats["1"]["engine_pids"][0] != pids1[0]
