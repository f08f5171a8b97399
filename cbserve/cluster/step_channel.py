"""The scheduler -> worker hop without a Ray task per step: one TCP connection per worker rank.

A Ray actor call costs both processes ~1.3 ms of CPU in Ray's own threads (task submission, gRPC, the
reply), and on a small CPU node that time is taken from the model's threads every step. A Ray compiled graph
is cheap per call but its reader busy-polls a core while a step runs. This channel is a plain socket: the
worker rank serves it (``StepServer.serve`` on its model thread: read a pickled SchedulerOutput, run it,
write the pickled reply), the scheduler's RayExecutor talks to it from its event loop (``StepClient``); a step costs a
write and a read on each side (~0.3 ms of CPU in all). Ray still places, starts, watches and kills the
workers; only the per-step call moves here.

Frames are an 8-byte little-endian length then a pickle. The worker unpickles only what comes from the peer
that first sent the 32-byte token it handed out through Ray (an authenticated actor call); any other
connection is closed unread. Replies come back in the order the steps were sent (two may be in flight with
async scheduling). A step that raises on the worker comes back as a ``StepError`` reply; a closed
connection fails every pending step with ``ConnectionError``: either way the replica rebuilds its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
TOKEN_BYTES = 32
HANDSHAKE_TIMEOUT_S = 30.0


class StepError(RuntimeError):
    """The worker raised while running a step (its type and message)."""


@dataclass(frozen=True)
class StepAddress:
    host: str
    port: int
    token: bytes


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None when the peer closed the connection first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _no_delay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step is one small write: never hold it


class StepServer:
    """The worker end: ``serve()`` (blocking, on the thread the caller gives it) runs ``handler(step) ->
    reply`` one step at a time for the one peer holding the token, until that peer closes the connection."""

    def __init__(self, handler: Callable[[Any], Any], host: str) -> None:
        self.handler = handler
        self.token = secrets.token_bytes(TOKEN_BYTES)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # a node IP may be IPv6
        self._listener = socket.create_server((host, 0), family=family)
        self.address = StepAddress(host, self._listener.getsockname()[1], self.token)

    def serve(self) -> None:
        with self._accept() as conn:
            while True:
                header = _recv_exactly(conn, _LENGTH.size)
                if header is None:
                    return  # the scheduler closed the channel
                data = _recv_exactly(conn, _LENGTH.unpack(header)[0])
                if data is None:
                    return
                conn.sendall(self._reply(data))

    def _reply(self, data: bytes) -> bytes:
        try:
            reply: tuple[bool, Any] = (True, self.handler(pickle.loads(data)))
        except Exception as e:  # the scheduler sees it as this step's failure and rebuilds the workers
            logger.exception("step failed")
            reply = (False, f"{type(e).__name__}: {e}")
        return frame(dumps(reply))

    def _accept(self) -> socket.socket:
        """The first connection that presents the token; the listener closes after it."""
        with self._listener:
            while True:
                conn, peer = self._listener.accept()
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                try:
                    token = _recv_exactly(conn, TOKEN_BYTES)
                except OSError:
                    token = None
                if token is not None and hmac.compare_digest(token, self.token):
                    conn.settimeout(None)
                    _no_delay(conn)
                    return conn
                logger.warning("step channel: refused a connection from %s without the token", peer)
                conn.close()


class StepClient:
    """The scheduler end of one rank's channel (``await StepClient.connect(address)``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._pending: deque[asyncio.Future[Any]] = deque()
        self._broken: Exception | None = None
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, address: StepAddress) -> StepClient:
        reader, writer = await asyncio.open_connection(address.host, address.port)
        no_delay(writer)
        writer.write(address.token)
        return cls(reader, writer)

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
                ok, value = pickle.loads(await read_frame(self._reader))
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

    def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(Exception):
            self._writer.close()


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def frame(data: bytes) -> bytes:
    """``data`` with its length in front (what ``read_frame`` reads)."""
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame's bytes; IncompleteReadError when the peer closed the connection."""
    header = await reader.readexactly(_LENGTH.size)
    return await reader.readexactly(_LENGTH.unpack(header)[0])


def no_delay(writer: asyncio.StreamWriter) -> None:
    _no_delay(writer.get_extra_info("socket"))
