"""EngineClient.add across replicas (cluster/ingress/failover.py): a replica that refuses a request before admitting it
(queue full, gone), or is lost before the request's first output, is skipped for the next ready one; bad requests
are not retried; a request on two replicas as they were lost is failed as a suspect; a request past
request_timeout_s is aborted in its engine and ends with HTTP 504 (continuations after outputs and a P:D app's
legs: test_pd_failover.py).

The engines are fakes with the SchedulerActor's shape (client_fakes.py: ``output_address`` names a channel server
speaking the real wire format, which sends the replica's state first, answers each AddRequest on the channel, and
records the aborts and finishes written to it); the real actors' 429 path is crossed end to end in
tests/e2e/openai_server/test_tp2.py."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from client_fakes import (
    DROP,
    FULL,
    FakeEngine,
    Remote,
    State,
    client_over,
    close,
    collect,
    load_on,
    out,
    run_one,
    started,
)

import cbserve.cluster.ingress.failover as failover
from cbserve.cluster.channel.messages import (
    EngineFailure,
    EngineState,
)
from cbserve.cluster.ingress.engine_client import EngineClient
from cbserve.cluster.ingress.router import Router
from cbserve.config import CBServeConfig
from cbserve.frontend.protocol import APIError


def test_a_full_replica_is_skipped_for_the_next() -> None:
    full, ok = FakeEngine([FULL]), FakeEngine([[], [out(7, True)]])
    client = client_over(full, ok)
    assert run_one(client, load_on(client)) == [out(7, True)]  # the full replica was the first choice
    assert (full.calls, ok.calls) == (1, 1)
    assert full.aborted == [] and ok.aborted == []  # both streams ended on the engines' side
    assert [r.outstanding_tokens for r in client.router.replicas] == [0, 1000]  # nothing leaked


def test_every_replica_full_gives_429() -> None:
    a, b = FakeEngine([FULL]), FakeEngine([FULL])
    with pytest.raises(APIError) as info:
        run_one(client_over(a, b))
    assert info.value.status == 429
    assert (a.calls, b.calls) == (1, 1)


def test_a_replica_that_says_it_is_gone_is_skipped_until_it_is_ready_again() -> None:
    gone, ok = FakeEngine([EngineFailure("unavailable", "engine is restarting")]), FakeEngine([[], [out(8, True)]])
    client = client_over(gone, ok)
    assert run_one(client, load_on(client)) == [out(8, True)]
    assert client.router.healthy_replicas() == [1]


def test_a_replica_lost_before_the_first_output_hands_the_request_over() -> None:
    """Admitted, then the replica's worker died before any output: the request runs on the other replica."""
    dying = FakeEngine([[], EngineFailure("unavailable", "engine replica 0 failed")])
    other = FakeEngine([[], [out(5)], [out(6, True)]])
    client = client_over(dying, other)
    assert run_one(client, load_on(client)) == [out(5), out(6, True)]
    assert (dying.calls, other.calls) == (1, 1) and client.router.healthy_replicas() == [1]
    assert [r.outstanding_tokens for r in client.router.replicas] == [0, 1000]
    assert [r.pending_prefill_tokens for r in client.router.replicas] == [0, 0]  # each attempt's prefill counted off


def test_a_request_failing_over_waits_for_room_on_a_full_replica() -> None:
    """Admitted, then its replica was lost: the app took it, so the other replica's full queue makes it wait and
    ask again (a new request would get a 429), and it runs there once there is room."""
    dying = FakeEngine([[], EngineFailure("unavailable", "engine replica 0 failed")])
    busy = FakeEngine([FULL], later=[[], [out(5)], [out(6, True)]])
    client = client_over(dying, busy)
    assert run_one(client, load_on(client)) == [out(5), out(6, True)]
    assert (dying.calls, busy.calls) == (1, 2)
    assert [r.outstanding_tokens for r in client.router.replicas] == [0, 1000]  # nothing leaked


def test_a_new_request_waits_for_room_while_a_replica_is_down() -> None:
    """One replica restarting, the other full (it took the lost one's requests): a new request waits for room instead
    of a 429, and runs once there is some."""
    down = FakeEngine([[], [out(1, True)]], state="restarting")
    busy = FakeEngine([FULL], later=[[], [out(5)], [out(6, True)]])
    client = client_over(down, busy)
    assert run_one(client) == [out(5), out(6, True)]
    assert (down.calls, busy.calls) == (0, 2)


def test_a_request_on_two_replicas_as_they_were_lost_is_failed_as_a_suspect() -> None:
    a = FakeEngine([[], EngineFailure("unavailable", "engine replica 0 failed")])
    b = FakeEngine([[], EngineFailure("unavailable", "engine replica 1 failed")])
    with pytest.raises(APIError) as info:
        run_one(client_over(a, b))
    assert info.value.status == 500 and "not retried again" in info.value.message
    assert (a.calls, b.calls) == (1, 1)


def test_a_channel_that_breaks_before_admission_sends_the_request_elsewhere() -> None:
    """The replica's channel closed with the AddRequest unanswered: the request fails over, unseen."""
    gone, ok = FakeEngine([DROP]), FakeEngine([[], [out(3, True)]])
    client = client_over(gone, ok)
    assert run_one(client, load_on(client)) == [out(3, True)]
    assert (gone.calls, ok.calls) == (1, 1)


def test_with_no_replica_ready_a_request_waits_for_one_to_come_back() -> None:
    """Replica 0 is lost with the request unanswered while replica 1 is still being rebuilt: the request waits
    (up to FAILOVER_WAIT_S) and runs on replica 1 once it is ready, instead of a 503."""
    gone, back = FakeEngine([DROP], state="ready"), FakeEngine([[], [out(4, True)]], state="restarting")

    def later_ready(client: EngineClient) -> None:
        asyncio.get_running_loop().call_later(0.3, client._set_state, 1, EngineState("ready", 2))

    client = client_over(gone, back)
    assert run_one(client, later_ready) == [out(4, True)]
    assert back.calls == 1 and gone.calls >= 1


def test_no_wait_when_every_replica_failed_for_good_and_a_bounded_one_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for state, least_s, most_s in (("failed", 0.0, 0.5), ("restarting", 0.3, 2.0)):
        monkeypatch.setattr(failover, "FAILOVER_WAIT_S", 0.3 if state == "restarting" else 5.0)
        client = client_over(FakeEngine([[]], state=state))
        t0 = asyncio.run(_clock())
        with pytest.raises(APIError) as info:
            run_one(client)
        waited = asyncio.run(_clock()) - t0
        assert info.value.status == 503 and "no engine replica is ready" in info.value.message
        assert least_s <= waited <= most_s + 0.5, (state, waited)


async def _clock() -> float:
    return asyncio.get_running_loop().time()


def test_a_stop_string_finish_reaches_the_engine_on_the_channel() -> None:
    engine = FakeEngine([[], [out(1)]])
    client = client_over(engine)

    def stop(got: list[Any]) -> bool:
        client.finish("r1", 0)
        return True

    assert run_one(client, stop=stop) == [out(1)]
    assert engine.finished == [("r1", 0)] and engine.aborted == ["r1"]  # then the stream was left: aborted


@pytest.mark.parametrize(("kind", "status"), [("rejected", 400), ("failed", 500)])
def test_a_bad_request_or_one_whose_own_step_failed_is_not_retried(kind: str, status: int) -> None:
    bad, other = FakeEngine([[], EngineFailure(kind, "its step failed")]), FakeEngine([[], [out(1, True)]])
    client = client_over(bad, other)
    with pytest.raises(APIError) as info:
        run_one(client, load_on(client))
    assert info.value.status == status and other.calls == 0


def test_a_request_past_its_timeout_is_aborted_with_504() -> None:
    slow = FakeEngine([[], [out(1)]])
    client = client_over(slow, request_timeout_s=0.3)
    got: list[Any] = []

    async def run() -> float:
        await started(client)
        t0 = asyncio.get_running_loop().time()
        try:
            with pytest.raises(APIError) as info:
                got.extend(await collect(client, State(), stop=lambda g: got.extend(g) and False))
            assert info.value.status == 504 and "request_timeout_s" in str(info.value.body())
            assert info.value.body()["error"]["type"] == "timeout"
            return asyncio.get_running_loop().time() - t0
        finally:
            await close(client)

    assert 0.3 <= asyncio.run(run()) < 5
    assert got[:1] == [[out(1)]]  # what came before the deadline was passed on
    assert slow.aborted == ["r1"]  # the engine was told to abort (and free) it
    assert client.router.replicas[0].outstanding_tokens == 0


def test_fail_all_ends_requests_in_flight_with_503_and_aborts_them() -> None:
    """What the ingress's drain does with the requests left at its deadline."""
    slow = FakeEngine([[], [out(1)]])
    client = client_over(slow)

    def fail_all(got: list[Any]) -> bool:
        client.fail_all("the server is shutting down; retry the request")
        return False

    with pytest.raises(APIError) as info:
        run_one(client, stop=fail_all)
    assert info.value.status == 503 and "shutting down" in info.value.message
    assert slow.aborted and set(slow.aborted) == {"r1"}


def test_no_timeout_by_default_and_a_fast_request_is_untouched() -> None:
    assert run_one(client_over(FakeEngine([[], [out(1, True)]]))) == [out(1, True)]
    fast = FakeEngine([[], [out(1, True)]])
    assert run_one(client_over(fast, request_timeout_s=30)) == [out(1, True)]
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
            return Remote(lambda *args: created.append((kw, args)) or object())

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
