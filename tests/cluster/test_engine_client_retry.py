"""EngineClient.generate across replicas: a replica that refuses a request before admitting it (queue full,
gone), or is lost before the request's first token, is skipped for the next healthy one; failures after tokens
were streamed and bad requests are not retried; a
request past request_timeout_s is aborted in its engine and ends with HTTP 504.

The engines are fakes with the SchedulerActor's shape (``output_address`` names a channel server speaking the
real wire format, tests/cluster/channel_fakes.py, which answers each AddRequest on the channel, and records the
aborts and finishes written to it); the real actors' 429 path is crossed end to end in
tests/e2e/openai_server/test_tp2.py."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from channel_fakes import FakeChannelServer, Inbox

from cbserve.cluster.engine_client import EngineClient
from cbserve.cluster.engine_messages import ADMITTED, AbortRequest, AddRequest, EngineFailure, FinishSequence
from cbserve.cluster.output_channel import ChannelReader
from cbserve.cluster.router import Router
from cbserve.config import CBServeConfig
from cbserve.frontend.protocol import APIError
from cbserve.scheduler.request import EngineRequest, RequestOutput
from cbserve.scheduler.sampling_params import SamplingParams


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


def _out(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r1", 0, [token], None, finished=finished, finish_reason="length" if finished else None)


DROP = "drop"


class FakeEngine:
    """Answers each AddRequest on the channel: refuses it with ``items[0]`` when that is an EngineFailure, closes
    the channel when it is ``DROP`` (the actor died), else admits it and sends each later item as one channel batch
    for the request; then sends nothing more (a long generation). Aborts and finishes are recorded."""

    def __init__(self, items: list[Any], hang: bool = False) -> None:
        self.items = items
        self.hang = hang
        self.calls = 0
        self.aborted: list[str] = []
        self.finished: list[tuple[str, int]] = []
        self.channel = FakeChannelServer(self._channel)
        self.output_address = _Remote(self.channel.address)

    async def _channel(self, channel: str, inbox: Inbox) -> Any:
        while True:
            msg = await inbox.get()
            if isinstance(msg, AbortRequest):
                self.aborted.append(msg.req_id)
            elif isinstance(msg, FinishSequence):
                self.finished.append((msg.req_id, msg.index))
            elif isinstance(msg, AddRequest):
                self.calls += 1
                req_id = msg.request.req_id
                if self.items[0] == DROP:
                    return
                if isinstance(self.items[0], EngineFailure):
                    yield {req_id: [self.items[0]]}
                    continue
                yield {req_id: [ADMITTED]}
                for item in self.items[1:]:
                    yield {req_id: item if isinstance(item, list) else [item]}


def _client(*engines: FakeEngine, request_timeout_s: float | None = None) -> EngineClient:
    client = object.__new__(EngineClient)  # no Ray: the fakes stand in for the SchedulerActors
    client.config = CBServeConfig(request_timeout_s=request_timeout_s, device="cpu")
    client.router = Router(len(engines), block_size=4)
    for i in range(len(engines)):
        client.router.set_healthy(i, True)
    client.engines = list(engines)
    client.channels = [ChannelReader(e, "owner") for e in engines]
    client.health = [{"state": "ready"} for _ in engines]
    client._routes = {}
    return client


def _run(client: EngineClient, req_id: str = "r1") -> list[Any]:
    request = EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4))

    async def collect() -> list[Any]:
        try:
            return [item async for item in client.generate(request)]
        finally:
            await _close(client)

    return asyncio.run(collect())


async def _close(client: EngineClient) -> None:
    """The fakes' channels stay open: close their readers and servers inside the test's loop."""
    tasks = [c._task for c in client.channels if c._task is not None]
    for channel in client.channels:
        channel.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    for engine in client.engines:
        await engine.channel.close()


FULL = EngineFailure("queue_full", "waiting queue is full")


def test_a_full_replica_is_skipped_for_the_next() -> None:
    full, ok = FakeEngine([FULL]), FakeEngine([[], [_out(7, True)]])
    client = _client(full, ok)
    client.router.add(1, 1000)  # make the full replica the first choice (least loaded)
    assert _run(client) == [[], [_out(7, True)]]
    assert (full.calls, ok.calls) == (1, 1)
    assert full.aborted == [] and ok.aborted == []  # both streams ended on the engines' side
    assert [r.outstanding_tokens for r in client.router.replicas] == [0, 1000]  # nothing leaked
    assert client._routes == {}


def test_every_replica_full_gives_429() -> None:
    a, b = FakeEngine([FULL]), FakeEngine([FULL])
    with pytest.raises(APIError) as info:
        _run(_client(a, b))
    assert info.value.status == 429
    assert (a.calls, b.calls) == (1, 1)


def test_a_gone_replica_is_marked_down_and_skipped() -> None:
    gone, ok = FakeEngine([EngineFailure("unavailable", "engine is restarting")]), FakeEngine([[], [_out(8, True)]])
    client = _client(gone, ok)
    client.router.add(1, 1000)
    assert _run(client) == [[], [_out(8, True)]]
    assert client.router.healthy_replicas() == [1]


def test_a_replica_lost_before_the_first_token_hands_the_request_over() -> None:
    """Admitted, then the replica's worker died before any output: the request runs on the other replica, and
    the caller sees one admission and the other replica's tokens."""
    dying = FakeEngine([[], EngineFailure("unavailable", "engine replica 0 failed")])
    other = FakeEngine([[], [_out(5)], [_out(6, True)]])
    client = _client(dying, other)
    client.router.add(1, 1000)
    assert _run(client) == [[], [_out(5)], [_out(6, True)]]
    assert (dying.calls, other.calls) == (1, 1) and client.router.healthy_replicas() == [1]
    assert [r.outstanding_tokens for r in client.router.replicas] == [0, 1000] and client._routes == {}
    assert [r.pending_prefill_tokens for r in client.router.replicas] == [0, 0]  # each attempt's prefill counted off


def test_a_channel_that_breaks_before_admission_sends_the_request_elsewhere() -> None:
    """The replica's channel closed with the AddRequest unanswered: the request fails over, unseen."""
    gone, ok = FakeEngine([DROP]), FakeEngine([[], [_out(3, True)]])
    client = _client(gone, ok)
    client.router.add(1, 1000)
    assert _run(client) == [[], [_out(3, True)]]
    assert (gone.calls, ok.calls) == (1, 1) and client.router.healthy_replicas() == [1]


def test_with_no_replica_ready_a_request_waits_for_one_to_come_back() -> None:
    """Replica 0 is lost with the request unanswered while replica 1 is still being rebuilt: the request waits
    (up to FAILOVER_WAIT_S) and runs on replica 1 once it is ready, instead of a 503."""
    gone, back = FakeEngine([DROP]), FakeEngine([[], [_out(4, True)]])
    client = _client(gone, back)
    client.router.set_healthy(1, False)
    client.health[1] = {"state": "restarting"}

    async def collect() -> list[Any]:
        asyncio.get_running_loop().call_later(0.3, client.router.set_healthy, 1, True)
        try:
            return [item async for item in client.generate(EngineRequest("r1", [1, 2, 3], SamplingParams()))]
        finally:
            await _close(client)

    assert asyncio.run(collect()) == [[], [_out(4, True)]]
    assert (gone.calls, back.calls) == (1, 1)


def test_no_wait_when_every_replica_failed_for_good_and_a_bounded_one_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cbserve.cluster.engine_client as engine_client

    client = _client(FakeEngine([[]]))
    client.router.set_healthy(0, False)
    client.health[0] = {"state": "failed", "error": "the model cannot load"}
    monkeypatch.setattr(engine_client, "FAILOVER_WAIT_S", 5.0)
    for state, least_s, most_s in (("failed", 0.0, 0.5), ("restarting", 0.3, 2.0)):
        client.health[0] = {"state": state}
        if state == "restarting":
            monkeypatch.setattr(engine_client, "FAILOVER_WAIT_S", 0.3)
        t0 = asyncio.run(_clock())
        with pytest.raises(APIError) as info:
            _run(client)
        waited = asyncio.run(_clock()) - t0
        assert info.value.status == 503 and "no engine replica is ready" in info.value.message
        assert least_s <= waited <= most_s, (state, waited)


async def _clock() -> float:
    return asyncio.get_running_loop().time()


def test_a_stop_string_finish_reaches_the_engine_on_the_channel() -> None:
    engine = FakeEngine([[], [_out(1)]], hang=True)
    client = _client(engine)
    got: list[Any] = []

    async def collect() -> None:
        async for item in client.generate(EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))):
            got.append(item)
            if len(got) == 2:
                client.finish("r1", 0)
                return

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(collect())
    finally:
        loop.run_until_complete(_close(client))
        loop.close()
    assert engine.finished == [("r1", 0)] and engine.aborted == ["r1"]  # then the stream was left: aborted


def test_failure_after_tokens_is_not_retried() -> None:
    dying, other = FakeEngine([[], [_out(1)], EngineFailure("unavailable", "lost")]), FakeEngine([[], [_out(2, True)]])
    client = _client(dying, other)
    client.router.add(1, 1000)
    with pytest.raises(APIError) as info:
        _run(client)
    assert info.value.status == 503
    assert other.calls == 0  # tokens were already streamed: a retry would repeat them


def test_bad_request_is_not_retried() -> None:
    bad, other = FakeEngine([EngineFailure("rejected", "prompt too long")]), FakeEngine([[], [_out(1, True)]])
    client = _client(bad, other)
    client.router.add(1, 1000)
    with pytest.raises(APIError) as info:
        _run(client)
    assert info.value.status == 400 and other.calls == 0


def test_a_request_past_its_timeout_is_aborted_with_504() -> None:
    slow = FakeEngine([[], [_out(1)]], hang=True)
    client = _client(slow, request_timeout_s=0.3)
    got: list[Any] = []

    async def collect() -> None:
        async for item in client.generate(EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))):
            got.append(item)

    loop = asyncio.new_event_loop()
    try:
        t0 = loop.time()
        with pytest.raises(APIError) as info:
            loop.run_until_complete(collect())
        elapsed = loop.time() - t0
    finally:
        loop.run_until_complete(_close(client))
        loop.close()
    assert info.value.status == 504 and "request_timeout_s" in str(info.value.body())
    assert info.value.body()["error"]["type"] == "timeout"
    assert 0.3 <= elapsed < 5
    assert got == [[], [_out(1)]]  # what came before the deadline was passed on
    assert slow.aborted == ["r1"]  # the engine was told to abort (and free) it
    assert client._routes == {} and client.router.replicas[0].outstanding_tokens == 0


def test_fail_all_ends_requests_in_flight_with_503_and_aborts_them() -> None:
    """What the ingress's drain does with the requests left at its deadline."""
    slow = FakeEngine([[], [_out(1)]], hang=True)
    client = _client(slow)
    got: list[Any] = []

    async def collect() -> None:
        async for item in client.generate(EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))):
            got.append(item)
            if len(got) == 2:
                client.fail_all("the server is shutting down; retry the request")

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(APIError) as info:
            loop.run_until_complete(collect())
    finally:
        loop.run_until_complete(_close(client))
        loop.close()
    assert info.value.status == 503 and "shutting down" in info.value.message
    assert got == [[], [_out(1)]] and slow.aborted == ["r1"] and client._routes == {}


def test_no_timeout_by_default_and_a_fast_request_is_untouched() -> None:
    assert _run(_client(FakeEngine([[], [_out(1, True)]]))) == [[], [_out(1, True)]]
    fast = FakeEngine([[], [_out(1, True)]])
    assert _run(_client(fast, request_timeout_s=30)) == [[], [_out(1, True)]]
    assert fast.aborted == []


def test_router_exclude() -> None:
    r = Router(3, block_size=4)
    for i in range(3):
        r.set_healthy(i, True)
    assert r.choose([1, 2, 3], exclude={0, 1}) == 2
    with pytest.raises(Exception, match="every ready replica is full"):
        r.choose([1, 2, 3], exclude={0, 1, 2})


def test_the_engines_and_the_router_are_built_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """num_replicas, max_restarts and the routing fields reach the SchedulerActors and the Router."""
    from cbserve.cluster import engine_client

    created: list[tuple[dict[str, Any], tuple[Any, ...]]] = []

    class FakeActorClass:
        def options(self, **kw: Any) -> Any:
            return _Remote(lambda *args: created.append((kw, args)) or object())

    context = argparse.Namespace(get_node_id=lambda: "ab" * 28)
    monkeypatch.setattr(engine_client, "SchedulerActor", FakeActorClass())
    monkeypatch.setattr(engine_client.ray, "get_runtime_context", lambda: context)
    config = CBServeConfig(num_replicas=3, max_restarts=7, block_size=8, prefix_affinity_tokens=32,
                           affinity_max_imbalance_tokens=99, routing="round_robin", device="cpu")  # fmt: skip
    client = EngineClient(config, "app", "owner")
    assert len(client.engines) == 3 and len(client.router.replicas) == 3
    assert [kw["name"] for kw, _ in created] == [f"app:owner:engine-{i}" for i in range(3)]
    assert {kw["max_restarts"] for kw, _ in created} == {7}
    assert [args[1] for _, args in created] == ["0", "1", "2"]
    assert CBServeConfig.model_validate(created[0][1][0]) == config  # each engine gets the whole config
    r = client.router
    assert (r.block_size, r.affinity_tokens, r.max_imbalance_tokens, r.mode) == (8, 32, 99, "round_robin")
    assert not config.uses_kv_events  # the engines report no prefix-cache blocks to a router that ignores them
    assert CBServeConfig(device="cpu").routing == "cache_aware" and CBServeConfig(device="cpu").uses_kv_events
    assert not CBServeConfig(routing="affinity", device="cpu").uses_kv_events
    with pytest.raises(ValueError, match="routing"):
        CBServeConfig(routing="random", device="cpu")
