"""EngineClient.add across replicas (cluster/ingress/failover.py): a replica that refuses a request before admitting it
(queue full, gone), or is lost before the request's first output, is skipped for the next ready one; failures
after outputs were streamed and bad requests are not retried; a request on two replicas as they were lost is
failed as a suspect; a request past request_timeout_s is aborted in its engine and ends with HTTP 504.

The engines are fakes with the SchedulerActor's shape (``output_address`` names a channel server speaking the
real wire format, tests/cluster/channel_fakes.py, which sends the replica's state first, answers each AddRequest
on the channel, and records the aborts and finishes written to it); the real actors' 429 path is crossed end to
end in tests/e2e/openai_server/test_tp2.py."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import pytest
from channel_fakes import FakeChannelServer, Inbox

import cbserve.cluster.ingress.failover as failover
from cbserve.cluster.channel.messages import (
    ADMITTED,
    AbortRequest,
    AddRequest,
    EngineFailure,
    EngineState,
    FinishSequence,
    OutputFrame,
)
from cbserve.cluster.channel.reader import ChannelReader
from cbserve.cluster.ingress.engine_client import EngineClient
from cbserve.cluster.ingress.router import Router
from cbserve.config import CBServeConfig
from cbserve.frontend.protocol import APIError
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


def _out(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r1", 0, [token], None, finished=finished, finish_reason="length" if finished else None)


DROP = "drop"
FULL = EngineFailure("queue_full", "waiting queue is full")


class FakeEngine:
    """Tells its ``state`` first, then answers each AddRequest on the channel: refuses it with ``items[0]`` when
    that is an EngineFailure, closes the channel when it is ``DROP`` (the actor died), else admits it and sends each
    later item as one frame for the request, then nothing more (a long generation). Aborts and finishes are
    recorded."""

    def __init__(self, items: list[Any], state: str = "ready") -> None:
        self.items = items
        self.state = state
        self.calls = 0
        self.aborted: list[str] = []
        self.finished: list[tuple[str, int]] = []
        self.requests: list[EngineRequest] = []
        self.channel = FakeChannelServer(self._channel)
        self.output_address = _Remote(self.channel.address)

    async def _channel(self, channel: str, inbox: Inbox) -> Any:
        yield OutputFrame({}, None, EngineState(self.state, 1))
        while True:
            msg = await inbox.get()
            if isinstance(msg, AbortRequest):
                self.aborted.append(msg.req_id)
            elif isinstance(msg, FinishSequence):
                self.finished.append((msg.req_id, msg.index))
            elif isinstance(msg, AddRequest):
                self.calls += 1
                self.requests.append(msg.request)
                req_id = msg.request.req_id
                if self.items[0] == DROP:
                    self.state = "restarting"  # its actor is being restarted: it says so when it comes back
                    return
                if isinstance(self.items[0], EngineFailure):
                    yield {req_id: [self.items[0]]}
                    continue
                yield {req_id: [ADMITTED]}
                for item in self.items[1:]:
                    yield {req_id: item if isinstance(item, list) else [item]}


class _State:
    """What the engine client reads of the front end's RequestState (frontend/output.py)."""

    def __init__(self, req_id: str = "r1") -> None:
        self.request = EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4))
        self.queue: Any = None
        self.replica: int | None = None
        self.cost = self.prefill = 0
        self.finished = False

    def seen(self, batch: list[RequestOutput]) -> None:
        self.finished = self.finished or any(o.finished for o in batch)


def _client(*engines: FakeEngine, request_timeout_s: float | None = None) -> EngineClient:
    client = object.__new__(EngineClient)  # no Ray: the fakes stand in for the SchedulerActors
    client.config = CBServeConfig(request_timeout_s=request_timeout_s, device="cpu")
    client.router = Router(len(engines), block_size=4)
    client.engines, client.requests, client.pd = list(engines), {}, None
    client.readers = [ChannelReader(e, i, "owner", client) for i, e in enumerate(engines)]
    client.health = [{"replica": str(i), "state": "starting"} for i in range(len(engines))]
    client._changed, client._ticker = None, None
    return client


async def _started(client: EngineClient) -> None:
    client.start()
    await client.wait_started(10)


async def _collect(client: EngineClient, state: _State, stop: Any = None) -> list[Any]:
    """The request through ``client``: its batches until it finished (or ``stop(got)`` says so)."""
    client.requests[state.request.req_id] = state  # type: ignore[index]
    try:
        outputs = await client.add(state)  # type: ignore[arg-type]
        got: list[Any] = []
        try:
            async for batch in outputs:
                got.append(batch)
                state.seen(batch)
                if state.finished or (stop is not None and stop(got)):
                    break
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        return got
    finally:
        client.requests.pop(state.request.req_id)  # type: ignore[attr-defined]


def _run(client: EngineClient, setup: Any = None, stop: Any = None, state: _State | None = None) -> list[Any]:
    """The outputs the request got (the batches flattened: items that came together are handed over together)."""

    async def run() -> list[Any]:
        await _started(client)
        if setup is not None:
            setup(client)
        try:
            return [out for batch in await _collect(client, state or _State(), stop) for out in batch]
        finally:
            await _close(client)

    return asyncio.run(run())


async def _close(client: EngineClient) -> None:
    """Close the readers and the fakes' servers inside the test's loop."""
    tasks = [r._task for r in client.readers if r._task is not None]
    for reader in client.readers:
        reader.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    for engine in client.engines:
        await engine.channel.close()


def _load(client: EngineClient, idx: int = 1, tokens: int = 1000) -> Any:
    return lambda c: c.router.add(idx, tokens)


def test_a_full_replica_is_skipped_for_the_next() -> None:
    full, ok = FakeEngine([FULL]), FakeEngine([[], [_out(7, True)]])
    client = _client(full, ok)
    assert _run(client, _load(client)) == [_out(7, True)]  # the full replica was the first choice
    assert (full.calls, ok.calls) == (1, 1)
    assert full.aborted == [] and ok.aborted == []  # both streams ended on the engines' side
    assert [r.outstanding_tokens for r in client.router.replicas] == [0, 1000]  # nothing leaked


def test_every_replica_full_gives_429() -> None:
    a, b = FakeEngine([FULL]), FakeEngine([FULL])
    with pytest.raises(APIError) as info:
        _run(_client(a, b))
    assert info.value.status == 429
    assert (a.calls, b.calls) == (1, 1)


def test_a_replica_that_says_it_is_gone_is_skipped_until_it_is_ready_again() -> None:
    gone, ok = FakeEngine([EngineFailure("unavailable", "engine is restarting")]), FakeEngine([[], [_out(8, True)]])
    client = _client(gone, ok)
    assert _run(client, _load(client)) == [_out(8, True)]
    assert client.router.healthy_replicas() == [1]


def test_a_replica_lost_before_the_first_output_hands_the_request_over() -> None:
    """Admitted, then the replica's worker died before any output: the request runs on the other replica."""
    dying = FakeEngine([[], EngineFailure("unavailable", "engine replica 0 failed")])
    other = FakeEngine([[], [_out(5)], [_out(6, True)]])
    client = _client(dying, other)
    assert _run(client, _load(client)) == [_out(5), _out(6, True)]
    assert (dying.calls, other.calls) == (1, 1) and client.router.healthy_replicas() == [1]
    assert [r.outstanding_tokens for r in client.router.replicas] == [0, 1000]
    assert [r.pending_prefill_tokens for r in client.router.replicas] == [0, 0]  # each attempt's prefill counted off


def test_a_request_on_two_replicas_as_they_were_lost_is_failed_as_a_suspect() -> None:
    a = FakeEngine([[], EngineFailure("unavailable", "engine replica 0 failed")])
    b = FakeEngine([[], EngineFailure("unavailable", "engine replica 1 failed")])
    with pytest.raises(APIError) as info:
        _run(_client(a, b))
    assert info.value.status == 500 and "not retried again" in info.value.message
    assert (a.calls, b.calls) == (1, 1)


def test_a_channel_that_breaks_before_admission_sends_the_request_elsewhere() -> None:
    """The replica's channel closed with the AddRequest unanswered: the request fails over, unseen."""
    gone, ok = FakeEngine([DROP]), FakeEngine([[], [_out(3, True)]])
    client = _client(gone, ok)
    assert _run(client, _load(client)) == [_out(3, True)]
    assert (gone.calls, ok.calls) == (1, 1)


def test_with_no_replica_ready_a_request_waits_for_one_to_come_back() -> None:
    """Replica 0 is lost with the request unanswered while replica 1 is still being rebuilt: the request waits
    (up to FAILOVER_WAIT_S) and runs on replica 1 once it is ready, instead of a 503."""
    gone, back = FakeEngine([DROP], state="ready"), FakeEngine([[], [_out(4, True)]], state="restarting")

    def later_ready(client: EngineClient) -> None:
        asyncio.get_running_loop().call_later(0.3, client._set_state, 1, EngineState("ready", 2))

    client = _client(gone, back)
    assert _run(client, later_ready) == [_out(4, True)]
    assert back.calls == 1 and gone.calls >= 1


def test_no_wait_when_every_replica_failed_for_good_and_a_bounded_one_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for state, least_s, most_s in (("failed", 0.0, 0.5), ("restarting", 0.3, 2.0)):
        monkeypatch.setattr(failover, "FAILOVER_WAIT_S", 0.3 if state == "restarting" else 5.0)
        client = _client(FakeEngine([[]], state=state))
        t0 = asyncio.run(_clock())
        with pytest.raises(APIError) as info:
            _run(client)
        waited = asyncio.run(_clock()) - t0
        assert info.value.status == 503 and "no engine replica is ready" in info.value.message
        assert least_s <= waited <= most_s + 0.5, (state, waited)


async def _clock() -> float:
    return asyncio.get_running_loop().time()


def test_a_stop_string_finish_reaches_the_engine_on_the_channel() -> None:
    engine = FakeEngine([[], [_out(1)]])
    client = _client(engine)

    def stop(got: list[Any]) -> bool:
        client.finish("r1", 0)
        return True

    assert _run(client, stop=stop) == [_out(1)]
    assert engine.finished == [("r1", 0)] and engine.aborted == ["r1"]  # then the stream was left: aborted


def test_a_replica_lost_after_outputs_continues_the_stream_on_another() -> None:
    lost = EngineFailure("unavailable", "lost")
    dying, other = FakeEngine([[], [_out(1)], [_out(5)], lost]), FakeEngine([[], [_out(2)], [_out(3, True)]])
    client = _client(dying, other)
    got = _run(client, _load(client))
    assert [o.new_token_ids for o in got] == [[1], [5], [2], [3]]  # the client's stream goes on, nothing repeated
    go_on = other.requests[0]
    assert go_on.prompt_token_ids == [1, 2, 3, 1, 5] and go_on.sampling_params.max_tokens == 2
    assert all(o.num_prompt_tokens == 3 for o in got[2:])  # as the original request's outputs say


@pytest.mark.parametrize("params", [dict(presence_penalty=0.5), dict(n=2), dict(frequency_penalty=-1.0)])
def test_a_request_that_cannot_be_continued_ends_with_the_error(params: dict[str, Any]) -> None:
    dying, other = FakeEngine([[], [_out(1)], EngineFailure("unavailable", "lost")]), FakeEngine([[], [_out(2, True)]])
    client = _client(dying, other)
    state = _State()
    state.request = EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, **params))
    with pytest.raises(APIError) as info:
        _run(client, _load(client), state=state)
    assert info.value.status == 503
    assert other.calls == 0  # its outputs were streamed and a continuation would change what it samples


@pytest.mark.parametrize(("kind", "status"), [("rejected", 400), ("failed", 500)])
def test_a_bad_request_or_one_whose_own_step_failed_is_not_retried(kind: str, status: int) -> None:
    bad, other = FakeEngine([[], EngineFailure(kind, "its step failed")]), FakeEngine([[], [_out(1, True)]])
    client = _client(bad, other)
    with pytest.raises(APIError) as info:
        _run(client, _load(client))
    assert info.value.status == status and other.calls == 0


def test_a_request_past_its_timeout_is_aborted_with_504() -> None:
    slow = FakeEngine([[], [_out(1)]])
    client = _client(slow, request_timeout_s=0.3)
    got: list[Any] = []

    async def run() -> float:
        await _started(client)
        t0 = asyncio.get_running_loop().time()
        try:
            with pytest.raises(APIError) as info:
                got.extend(await _collect(client, _State(), stop=lambda g: got.extend(g) and False))
            assert info.value.status == 504 and "request_timeout_s" in str(info.value.body())
            assert info.value.body()["error"]["type"] == "timeout"
            return asyncio.get_running_loop().time() - t0
        finally:
            await _close(client)

    assert 0.3 <= asyncio.run(run()) < 5
    assert got[:1] == [[_out(1)]]  # what came before the deadline was passed on
    assert slow.aborted == ["r1"]  # the engine was told to abort (and free) it
    assert client.router.replicas[0].outstanding_tokens == 0


def test_fail_all_ends_requests_in_flight_with_503_and_aborts_them() -> None:
    """What the ingress's drain does with the requests left at its deadline."""
    slow = FakeEngine([[], [_out(1)]])
    client = _client(slow)

    def fail_all(got: list[Any]) -> bool:
        client.fail_all("the server is shutting down; retry the request")
        return False

    with pytest.raises(APIError) as info:
        _run(client, stop=fail_all)
    assert info.value.status == 503 and "shutting down" in info.value.message
    assert slow.aborted and set(slow.aborted) == {"r1"}


def test_no_timeout_by_default_and_a_fast_request_is_untouched() -> None:
    assert _run(_client(FakeEngine([[], [_out(1, True)]]))) == [_out(1, True)]
    fast = FakeEngine([[], [_out(1, True)]])
    assert _run(_client(fast, request_timeout_s=30)) == [_out(1, True)]
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
    from cbserve.cluster.ingress import engine_client

    created: list[tuple[dict[str, Any], tuple[Any, ...]]] = []

    class FakeActorClass:
        def options(self, **kw: Any) -> Any:
            return _Remote(lambda *args: created.append((kw, args)) or object())

    context = argparse.Namespace(get_node_id=lambda: "ab" * 28)
    monkeypatch.setattr(engine_client, "SchedulerActor", FakeActorClass())
    monkeypatch.setattr(engine_client.ray, "get_runtime_context", lambda: context)
    config = CBServeConfig(num_replicas=3, max_restarts=7, block_size=8, prefix_affinity_tokens=32,
                           affinity_max_imbalance_tokens=99, routing="round_robin", device="cpu")  # fmt: skip
    client = EngineClient(config, "app", "owner", {})
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


# ---- a P:D app (cluster/ingress/disaggregation.py): replica 0 prefills, replica 1 decodes ----------------------------
ANSWER = {"do_remote_prefill": True, "remote_engine_id": "key-1-abc", "remote_block_ids": [0]}


def _pd(prefill: FakeEngine, decode: FakeEngine) -> EngineClient:
    from cbserve.cluster.ingress.disaggregation import Disaggregation
    from cbserve.config.pd_config import PDConfig

    client = _client(prefill, decode)
    client.pd = Disaggregation(PDConfig(prefill_replicas=1, decode_replicas=1, min_remote_prefill_tokens=0),
                               client.router)  # fmt: skip
    return client


def test_pd_the_prefill_legs_answer_goes_with_the_request_to_the_decode_replica() -> None:
    first = RequestOutput("r1", 0, [5], None, finished=True, finish_reason="length", kv_transfer_params=ANSWER)
    prefill, decode = FakeEngine(["ok", first]), FakeEngine(["ok", _out(7, finished=True)])
    client = _pd(prefill, decode)
    got = _run(client)
    assert [o.new_token_ids for o in got] == [[7]]  # the prefill leg's token is never the client's
    p, d = prefill.requests[0], decode.requests[0]
    assert p.sampling_params.max_tokens == 1 and p.kv_transfer is not None and p.kv_transfer.remote_decode
    assert d.kv_transfer is not None and (d.kv_transfer.remote_engine, d.kv_transfer.remote_blocks) == ("key-1-abc", 1)
    assert d.sampling_params.max_tokens == 4 and not prefill.aborted and not decode.aborted
    assert client.router.take_stats().disaggregation == {"remote": 1}


@pytest.mark.parametrize("prefill_items", [[DROP], [FULL], ["ok", EngineFailure("failed", "its step failed")]])
def test_pd_a_prefill_leg_that_fails_leaves_the_prompt_to_the_decode_replica(prefill_items: list[Any]) -> None:
    prefill, decode = FakeEngine(prefill_items), FakeEngine(["ok", _out(7, finished=True)])
    client = _pd(prefill, decode)
    t0 = time.monotonic()
    got = _run(client)
    assert [o.new_token_ids for o in got] == [[7]] and decode.requests[0].kv_transfer is None
    assert time.monotonic() - t0 < failover.FAILOVER_WAIT_S / 2  # no waiting for a prefill replica to come back
    assert client.router.take_stats().disaggregation == {"local_failed": 1}
