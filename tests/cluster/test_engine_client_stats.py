"""EngineClient.stats (/stats): a replica whose channel broke is reported "unreachable" at once, from the ingress's
own view (the one liveness signal: the channel's end), without a call to its actor, which Ray would hold until the
actor is back or the call times out; the other replicas answer for themselves. Over client_fakes.py's engines."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from client_fakes import FakeEngine, Remote, client_over, close, started


def _answers(state: str) -> Remote:
    async def stats() -> dict[str, Any]:
        return {"replica": "1", "state": state, "num_in_flight": 0}

    return Remote(stats)


def _never_answers(calls: list[float]) -> Remote:
    async def stats() -> dict[str, Any]:  # a dead actor being restarted: the call waits
        calls.append(time.monotonic())
        await asyncio.sleep(3600)
        return {}

    return Remote(stats)


def _stats(first: FakeEngine, second: FakeEngine, timeout_s: float, broken: str | None = None) -> list[dict[str, Any]]:
    """/stats over a client of the two engines (replica 0's channel reported broken with ``broken`` first)."""

    async def run() -> list[dict[str, Any]]:
        client = client_over(first, second)
        await started(client)
        try:
            if broken is not None:
                client.broken(0, broken)  # as the channel reader reports an end of file
            return await asyncio.wait_for(client.stats(), timeout_s)
        finally:
            await close(client)

    return asyncio.run(run())


def test_a_replica_whose_channel_broke_is_unreachable_at_once_without_a_call() -> None:
    lost, alive, calls = FakeEngine([]), FakeEngine([]), []
    lost.stats, alive.stats = _never_answers(calls), _answers("ready")  # type: ignore[attr-defined]
    first, second = _stats(lost, alive, 1.0, broken="its engine actor closed the channel")
    assert first["state"] == "unreachable" and first["error"] == "its engine actor closed the channel", first
    assert calls == []  # its actor was not asked
    assert second["state"] == "ready" and second["num_in_flight"] == 0, second


def test_a_ready_replica_is_asked_and_a_silent_one_times_out_as_unreachable(monkeypatch: Any) -> None:
    import cbserve.cluster.ingress.engine_client as engine_client

    monkeypatch.setattr(engine_client, "STATS_TIMEOUT_S", 0.2)
    silent, alive, calls = FakeEngine([]), FakeEngine([]), []
    silent.stats, alive.stats = _never_answers(calls), _answers("ready")  # type: ignore[attr-defined]
    first, second = _stats(silent, alive, 5.0)
    assert len(calls) == 1 and first["state"] == "unreachable" and first["error"] == "TimeoutError", first
    assert second["state"] == "ready"
