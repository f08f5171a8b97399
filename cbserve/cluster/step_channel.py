"""The scheduler -> worker hop without a Ray task per step: one TCP connection per worker rank.

A Ray actor call costs both processes ~1.3 ms of CPU in Ray's own threads (task submission, gRPC, the
reply), and on a small CPU node that time is taken from the model's threads every step. A Ray compiled graph
is cheap per call but its reader busy-polls a core while a step runs. This channel is a plain socket: the
worker rank serves it (``StepServer.serve`` on its model thread: read a pickled SchedulerOutput, run it,
write the pickled reply), the scheduler's RayExecutor talks to it from its event loop (``StepClient``); a step costs a
write and a read on each side (~0.3 ms of CPU in all). Ray still places, starts, watches and kills the
workers; only the per-step call moves here.

The framing and the token handshake are transport.py's: the worker unpickles only what comes from the peer
that first sent the token it handed out through Ray; any other connection is closed unread. Replies come
back in the order the steps were sent (two may be in flight with async scheduling). A step that raised on the
worker is a reply like any other (its ``StepFailedError``, worker/step_guard.py: the engine fails the requests to
blame); an error outside the step (a bug of the channel's own) comes back as a ``StepError`` reply. The
connection is the rank's liveness signal: closed (its process died) or silent under TCP keepalive (its node
vanished, ``transport.KEEPALIVE_S``), it fails every pending step with ``ConnectionError`` and tells the executor
(``on_closed``), which rebuilds the workers, idle or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from cbserve.cluster.transport import (
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

__all__ = ["StepAddress", "StepClient", "StepError", "StepServer", "dumps"]  # dumps: a step, pickled once for all ranks

logger = logging.getLogger(__name__)


class StepError(RuntimeError):
    """The worker raised while running a step (its type and message)."""


class StepServer:
    """The worker end: ``serve()`` (blocking, on the thread the caller gives it) runs ``handler(step) ->
    reply`` one step at a time for the one peer holding the token, until that peer closes the connection."""

    def __init__(self, handler: Callable[[Any], Any], host: str) -> None:
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
            reply: tuple[bool, Any] = (True, self.handler(loads(data)))
        except Exception as e:  # the scheduler sees it as this step's failure and rebuilds the workers
            logger.exception("step failed")
            reply = (False, f"{type(e).__name__}: {e}")
        return encode(reply)


class StepClient:
    """The scheduler end of one rank's channel (``await StepClient.connect(address)``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_closed: Callable[[str], None] | None = None) -> None:
        self._reader, self._writer = reader, writer
        self._on_closed = on_closed
        self._pending: deque[asyncio.Future[Any]] = deque()
        self._broken: Exception | None = None
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, address: StepAddress, on_closed: Callable[[str], None] | None = None) -> StepClient:
        """``on_closed(why)``: called once when the connection ends (the rank is gone, or ``close``)."""
        reader, writer = await connect(address)
        keep_alive(writer)
        return cls(reader, writer, on_closed)

    def call(self, data: bytes) -> asyncio.Future[Any]:
        """Send one pickled step; the future gets its reply (replies come back in order)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._broken is not None:
            future.set_exception(ConnectionError(f"step channel closed ({self._broken})"))
            return future
        self._pending.append(future)
        self._writer.write(frame(data))
        return future

    async def _read(self) -> None:
        try:
            while True:
                ok, value = await read_message(self._reader)
                future = self._pending.popleft()
                if future.done():  # cancelled by its caller
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(StepError(value))
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
