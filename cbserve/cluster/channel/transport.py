"""The framing both of cbserve's own sockets speak: the scheduler -> worker step channel (step_channel.py) and
the two-way channel between an ingress replica and an engine replica (output_channel.py).

A connection starts with the 32-byte token its server handed out through Ray (an authenticated actor call):
the server reads nothing else from a peer until the token matched, and closes any connection that does not
present it, so it only ever unpickles what an authenticated peer sent. After the token, each message is one
frame: an 8-byte little-endian length, then a pickle. Both ends set TCP_NODELAY: a message is one small write
that must not wait for the next one.

The blocking helpers (``recv_exactly``, ``recv_frame``, ``accept_with_token``) serve the step channel's worker
end, which runs on its own thread; the asyncio ones (``read_frame``, ``read_token``, ``connect``) the other
ends, which run on event loops.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
TOKEN_BYTES = 32
HANDSHAKE_TIMEOUT_S = 30.0
# TCP keepalive of a connection to another node (``keep_alive``): probes after 1 s of silence, 1 s apart, 3 lost
# ones close it. A peer whose node vanished (no FIN ever comes) is noticed within about this many seconds.
KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class StepAddress:
    """Where a channel's server listens, and the token it lets in."""

    host: str
    port: int
    token: bytes


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def frame(data: bytes) -> bytes:
    """``data`` with its length in front (what ``read_frame`` and ``recv_frame`` read)."""
    return _LENGTH.pack(len(data)) + data


def encode(obj: Any) -> bytes:
    """``obj`` pickled, as one frame."""
    return frame(dumps(obj))


def no_delay(conn: socket.socket | asyncio.StreamWriter) -> None:
    sock = conn.get_extra_info("socket") if isinstance(conn, asyncio.StreamWriter) else conn
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on the connection (see ``KEEPALIVE_S``): the kernel of a live peer answers the probes however
    long its process computes; a peer host that is gone does not, and the connection fails."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux (and most others); elsewhere the system's keepalive times apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# ---- asyncio ends -----------------------------------------------------------------------------
async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame's bytes; IncompleteReadError when the peer closed the connection."""
    header = await reader.readexactly(_LENGTH.size)
    return await reader.readexactly(_LENGTH.unpack(header)[0])


async def read_message(reader: asyncio.StreamReader) -> Any:
    """One frame, unpickled (only ever from a peer that presented the token)."""
    return pickle.loads(await read_frame(reader))


async def read_token(reader: asyncio.StreamReader, token: bytes) -> bool:
    """Whether the peer's first bytes are ``token`` (read within HANDSHAKE_TIMEOUT_S)."""
    try:
        got = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HANDSHAKE_TIMEOUT_S)
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        return False
    return hmac.compare_digest(got, token)


async def connect(address: StepAddress) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``address`` with the token sent (buffered: the caller's first frame joins it)."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    no_delay(writer)
    writer.write(address.token)
    return reader, writer


# ---- blocking ends ----------------------------------------------------------------------------
def recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None when the peer closed the connection first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(conn: socket.socket) -> bytes | None:
    """One frame's bytes, or None when the peer closed the connection."""
    header = recv_exactly(conn, _LENGTH.size)
    if header is None:
        return None
    return recv_exactly(conn, _LENGTH.unpack(header)[0])


def listen(host: str) -> socket.socket:
    """A listening socket on a free port of ``host`` (an IPv4 or IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family)


def accept_with_token(listener: socket.socket, token: bytes, what: str) -> socket.socket:
    """The first connection to ``listener`` that presents ``token`` (the others are closed unread)."""
    while True:
        conn, peer = listener.accept()
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            got = recv_exactly(conn, TOKEN_BYTES)
        except OSError:
            got = None
        if got is not None and hmac.compare_digest(got, token):
            conn.settimeout(None)
            no_delay(conn)
            return conn
        logger.warning("%s: refused a connection from %s without the token", what, peer)
        conn.close()
