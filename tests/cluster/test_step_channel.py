"""The scheduler -> worker socket hop (cluster/channel/steps.py), both ends in this process: replies in order
with two steps in flight, an exception in the worker's end of the hop as that step's ``StepReply.error`` (the
channel goes on), the token guarding the worker's unpickling, and a closed worker failing the pending steps and
telling its executor once."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from cbserve.cluster.channel.messages import StepReply
from cbserve.cluster.channel.steps import StepClient, StepServer
from cbserve.cluster.channel.transport import StepAddress, dumps


def _double(step: Any) -> StepReply:
    if step == "boom":
        raise ValueError("bad step")
    return StepReply([2 * x for x in step])  # type: ignore[arg-type]  # any picklable output, for the hop


def _start(server: StepServer) -> StepAddress:
    threading.Thread(target=server.serve, daemon=True).start()
    return server.address


def test_replies_come_back_in_order_with_steps_in_flight() -> None:
    threads: list[str] = []

    def handler(step: Any) -> StepReply:
        threads.append(threading.current_thread().name)
        return _double(step)

    server = StepServer(handler, "127.0.0.1")
    thread = threading.Thread(target=server.serve, name="model-thread")
    thread.start()
    address = server.address

    async def run() -> list[Any]:
        client = await StepClient.connect(address)
        futures = [client.call(dumps([i, i + 1])) for i in range(20)]  # all sent before any reply is read
        replies = await asyncio.gather(*futures)
        client.close()
        return replies

    assert [r.output for r in asyncio.run(run())] == [[2 * i, 2 * i + 2] for i in range(20)]
    assert set(threads) == {"model-thread"}  # every step ran on the thread serving the channel
    thread.join(10)
    assert not thread.is_alive()  # serve() returned when the scheduler closed the channel


def test_a_failing_hop_is_that_steps_error_and_the_channel_goes_on() -> None:
    address = _start(StepServer(_double, "127.0.0.1"))

    async def run() -> tuple[StepReply, StepReply]:
        client = await StepClient.connect(address)
        bad, good = client.call(dumps("boom")), client.call(dumps([5]))
        replies = await bad, await good
        client.close()
        return replies

    bad, good = asyncio.run(run())
    assert bad == StepReply(error="ValueError: bad step") and good.output == [10]


def test_a_peer_without_the_token_is_closed_unread() -> None:
    calls: list[Any] = []
    address = _start(StepServer(lambda s: calls.append(s) or StepReply("ran"), "127.0.0.1"))  # type: ignore
    with socket.create_connection((address.host, address.port)) as intruder:
        intruder.sendall(b"x" * 32 + dumps("step"))
        intruder.settimeout(10)
        try:
            answer = intruder.recv(16)
        except ConnectionResetError:  # closed with the step unread
            answer = b""
        assert answer == b""  # closed, nothing answered
    assert calls == []

    async def run() -> Any:
        client = await StepClient.connect(address)  # the real peer still gets in
        reply = await client.call(dumps("step"))
        client.close()
        return reply

    assert asyncio.run(run()).output == "ran" and calls == ["step"]


def test_a_worker_gone_fails_the_pending_steps_and_is_told_once() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    address = StepAddress("127.0.0.1", listener.getsockname()[1], b"t" * 32)
    lost: list[str] = []

    async def run() -> None:
        client = await StepClient.connect(address, lost.append)
        conn, _ = await asyncio.to_thread(listener.accept)
        pending = client.call(dumps("step"))
        conn.close()  # the worker process died mid-step
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(ConnectionError):  # and every later step fails at once
            await client.call(dumps("next"))
        client.close()

    asyncio.run(run())
    listener.close()
    assert len(lost) == 1 and "closed" in lost[0]


def _ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_worker_on_an_ipv6_address() -> None:
    address = _start(StepServer(_double, "::1"))

    async def run() -> Any:
        client = await StepClient.connect(address)
        reply = await client.call(dumps([21]))
        client.close()
        return reply

    assert asyncio.run(run()).output == [42]
