"""The scheduler -> worker hop without a Ray task per step: one TCP connection per worker rank (``SocketSteps``,
one of the executor's two step transports; the other is a Ray compiled graph, compiled_graph.py).

A Ray actor call costs both processes ~1.3 ms of CPU in Ray's own threads (task submission, gRPC, the
reply), and on a small CPU node that time is taken from the model's threads every step. A Ray compiled graph
is cheap per call but its reader busy-polls a core while a step runs. This channel is a plain socket: the
worker rank serves it (``StepServer.serve`` on its model thread: read a pickled SchedulerOutput, run it,
write the pickled ``StepReply``), the scheduler's RayExecutor talks to it from its event loop (``StepClient``); a
step costs a write and a read on each side (~0.3 ms of CPU in all). Ray still places, starts and kills the
workers; only the per-step call moves here.

The framing and the token handshake are transport.py's and the messages engine_messages.py's: the worker
unpickles only what comes from the peer that first sent the token it handed out through Ray; any other
connection is closed unread. Replies come back in the order the steps were sent (two may be in flight with async
scheduling). A step that raised on the worker is a reply like any other (``StepReply.failure``); the worker's
end of the hop failing itself is ``StepReply.error``. The connection is the rank's liveness signal: closed (its
process died) or silent under TCP keepalive (its node vanished, ``transport.KEEPALIVE_S``), it fails every
pending step with ``ConnectionError`` and tells the executor once (``on_lost``), which rebuilds the workers, idle
or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from cbserve.cluster.channel.messages import StepMessage, StepReply
from cbserve.cluster.channel.transport import (
    StepAddress,
    accept_with_token,
    connect,
    dumps,
    encode,
    frame,
    keep_alive,
    listen,
    loads,
    new_token,
    read_message,
    recv_frame,
)

logger = logging.getLogger(__name__)


class StepServer:
    """The worker end: ``serve()`` (blocking, on the thread the caller gives it) runs ``handler(step) -> StepReply``
    one step at a time for the one peer holding the token, until that peer closes the connection."""

    def __init__(self, handler: Callable[[StepMessage], StepReply], host: str) -> None:
        self.handler = handler
        self.token = new_token()
        self._listener = listen(host)  # a node IP may be IPv6
        self.address = StepAddress(host, self._listener.getsockname()[1], self.token)

    def serve(self) -> None:
        with self._listener:  # closes once the one peer is in
            conn = accept_with_token(self._listener, self.token, "step channel")
        with conn:
            while (data := recv_frame(conn)) is not None:  # None: the scheduler closed the channel
                conn.sendall(self._reply(data))

    def _reply(self, data: bytes) -> bytes:
        try:
            reply = self.handler(loads(data))
        except Exception as e:  # not the step's (the guard answers for those): the hop itself
            logger.exception("step channel failed")
            reply = StepReply(error=f"{type(e).__name__}: {e}")
        return encode(reply)


class StepClient:
    """The scheduler end of one rank's channel (``await StepClient.connect(address)``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_closed: Callable[[str], None] | None = None) -> None:
        self._reader, self._writer = reader, writer
        self._on_closed = on_closed
        self._pending: deque[asyncio.Future[StepReply]] = deque()
        self._broken: Exception | None = None
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, address: StepAddress, on_closed: Callable[[str], None] | None = None) -> StepClient:
        """``on_closed(why)``: called once when the connection ends (the rank is gone, or ``close``)."""
        reader, writer = await connect(address)
        keep_alive(writer)
        return cls(reader, writer, on_closed)

    def call(self, data: bytes) -> asyncio.Future[StepReply]:
        """Send one pickled step; the future gets its reply (replies come back in order)."""
        future: asyncio.Future[StepReply] = asyncio.get_running_loop().create_future()
        if self._broken is not None:
            future.set_exception(ConnectionError(f"step channel closed ({self._broken})"))
            return future
        self._pending.append(future)
        self._writer.write(frame(data))
        return future

    async def _read(self) -> None:
        try:
            while True:
                reply = await read_message(self._reader)
                future = self._pending.popleft()
                if not future.done():  # else cancelled by its caller
                    future.set_result(reply)
        except asyncio.CancelledError:
            self._fail(ConnectionError("step channel closed"))
            raise
        except (OSError, EOFError, asyncio.IncompleteReadError, IndexError) as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        self._broken = e
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"step channel to the worker broke ({type(e).__name__})"))
        if self._on_closed is not None:
            on_closed, self._on_closed = self._on_closed, None
            on_closed(f"its step channel closed ({type(e).__name__})")

    def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(Exception):
            self._writer.close()


class SocketSteps:
    """The step transport over one ``StepClient`` per rank: a step is pickled once and written to every rank."""

    def __init__(self, clients: list[StepClient]) -> None:
        self.clients = clients

    @classmethod
    async def connect(cls, workers: list[Any], on_lost: Callable[[str], None]) -> SocketSteps:
        """Open every rank's channel (``WorkerActor.open_step_channel``); ``on_lost(why)`` when one closes."""
        addresses = await asyncio.gather(*[w.open_step_channel.remote() for w in workers])
        clients = []
        for rank, address in enumerate(addresses):
            lost = lambda why, rank=rank: on_lost(f"worker rank {rank}: {why}")  # noqa: E731
            clients.append(await StepClient.connect(address, lost))
        return cls(clients)

    async def run(self, so: StepMessage) -> list[StepReply]:
        data = dumps(so)
        return list(await asyncio.gather(*[c.call(data) for c in self.clients]))

    def close(self) -> None:
        for client in self.clients:
            client.close()
