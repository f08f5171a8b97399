"""The engine end of the channel between an ingress replica and an engine replica: one two-way loopback TCP
connection per (ingress replica, engine replica), every request of the one multiplexed on it. The ingress end is
channel_reader.py; the messages are engine_messages.py; the framing and the token, transport.py.

The SchedulerActor serves it (``ChannelServer``, on the actor's event loop) beside its ingress (engine_client.py
pins it to that node). Each connection is one channel with a small index (``EngineRequest.client``: every output of
a request says which channel it goes back on, so the actor keeps no table of requests). The server hands each
message it reads to the actor (``on_message(client, message)``) and puts the answer it returns on the same channel:
an AddRequest's (``Admitted`` or its ``EngineFailure``), before any output of the request. Every step's outputs of
all the requests of one channel go out as ONE frame (``OutputFrame``), with the engine's prefix-cache events (for
the cache-aware router) and its state when it changed. A channel's first frame carries the replica's state and a
snapshot of its prefix cache. A Ray actor call would cost the two processes ~1.5 ms of CPU per message in Ray's
threads; a frame on a socket costs ~0.3 ms. Ray calls are left for the life cycle (``output_address``, stats,
shutdown).

The connection is the boundary's liveness signal, both ways: when the ingress goes (its process died, or it closed
the channel), the actor aborts the requests the channel sent (``on_closed``); when the actor's process dies, the
ingress sees the connection end at once (channel_reader.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cbserve.cluster.channel.messages import (
    AbortRequest,
    AddRequest,
    Batch,
    EngineState,
    FinishSequence,
    IngressMessage,
    Item,
    OpenChannel,
    OutputFrame,
)
from cbserve.cluster.channel.transport import (
    HANDSHAKE_TIMEOUT_S,
    StepAddress,
    encode,
    new_token,
    no_delay,
    read_message,
    read_token,
)
from cbserve.scheduler.kv.kv_events import KVCacheEvents, KVEventRecorder

logger = logging.getLogger(__name__)

# (client, message) -> the answer to put on that channel, as (request id, item), or None
MessageHandler = Callable[[int, IngressMessage], tuple[str, Item] | None]
_INGRESS_MESSAGES = (AddRequest, AbortRequest, FinishSequence)


class ChannelBuffer:
    """One channel's outputs, prefix-cache events and state, waiting until its stream takes them."""

    def __init__(self) -> None:
        self.pending: Batch = {}
        self.cache = KVEventRecorder()
        self.state: EngineState | None = None
        self.ready = asyncio.Event()

    def put(self, req_id: str, item: Item) -> None:
        items = self.pending.get(req_id)
        if items is None:
            self.pending[req_id] = [item]
        else:
            items.append(item)
        self.ready.set()

    def put_cache_events(self, events: KVCacheEvents) -> None:
        self.cache.add(events)
        self.ready.set()

    def put_state(self, state: EngineState) -> None:
        self.state = state
        self.ready.set()

    async def take(self) -> OutputFrame:
        """Everything put since the last take (waits until there is something)."""
        await self.ready.wait()
        frame = OutputFrame(self.pending, self.cache.take(), self.state)
        self.pending, self.state = {}, None
        self.ready.clear()
        return frame


class ChannelServer:
    """The engine end: a loopback TCP server; each connection is one channel (its reader sends the token, then
    ``OpenChannel``, then its messages). ``snapshot()``: the replica's state now and what its prefix cache and KV
    tiers hold (a reset ``KVCacheEvents``; None: it reports no prefix-cache events), sent first on every channel."""

    def __init__(self, on_message: MessageHandler, on_closed: Callable[[int], None],
                 snapshot: Callable[[], tuple[EngineState, KVCacheEvents | None]]) -> None:
        self.on_message = on_message
        self.on_closed = on_closed
        self.snapshot = snapshot
        self.buffers: dict[int, ChannelBuffer] = {}  # the connected channels, by client index
        self.token = new_token()
        self.address: StepAddress | None = None
        self._server: asyncio.Server | None = None
        self._next_client = 1  # 0: a request of no channel (the offline LLM's)

    async def start(self, host: str = "127.0.0.1") -> StepAddress:
        if self.address is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
            self.address = StepAddress(host, self._server.sockets[0].getsockname()[1], self.token)
        return self.address

    def put(self, client: int, req_id: str, item: Item) -> None:
        """An item for request ``req_id`` of channel ``client`` (dropped when that channel is gone)."""
        buffer = self.buffers.get(client)
        if buffer is not None:
            buffer.put(req_id, item)

    def put_cache_events(self, events: KVCacheEvents) -> None:
        """The engine's prefix cache changed: every channel carries the events with its next frame."""
        for buffer in self.buffers.values():
            buffer.put_cache_events(events)

    def put_state(self, state: EngineState) -> None:
        for buffer in self.buffers.values():
            buffer.put_state(state)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel_id = await self._handshake(reader)
        if channel_id is None:
            writer.close()
            return
        no_delay(writer)
        client, self._next_client = self._next_client, self._next_client + 1
        buffer = self.buffers[client] = ChannelBuffer()
        state, cached = self.snapshot()
        buffer.put_state(state)
        if cached is not None:
            buffer.put_cache_events(cached)
        receiving = asyncio.ensure_future(self._receive(client, channel_id, reader, asyncio.current_task()))
        try:
            while True:
                writer.write(encode(await buffer.take()))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the reader went away (or the actor is stopping)
        finally:
            receiving.cancel()
            writer.close()
            del self.buffers[client]
            self.on_closed(client)

    async def _handshake(self, reader: asyncio.StreamReader) -> str | None:
        """The channel id of a reader that presents the token and then ``OpenChannel``, else None (the connection
        is closed unread)."""
        if not await read_token(reader, self.token):
            logger.warning("engine channel: refused a connection without the token")
            return None
        try:
            hello = await asyncio.wait_for(read_message(reader), HANDSHAKE_TIMEOUT_S)
        except Exception:  # closed, too slow, or not a pickle
            return None
        if not isinstance(hello, OpenChannel):
            logger.warning("engine channel: refused a connection that sent %s before its channel id",
                           type(hello).__name__)
            return None
        return hello.channel_id

    async def _receive(self, client: int, channel_id: str, reader: asyncio.StreamReader,
                       serving: asyncio.Task[Any] | None) -> None:
        """The reader's messages, handed on in order until it closes the connection; then the channel ends."""
        try:
            while True:
                msg = await read_message(reader)
                if not isinstance(msg, _INGRESS_MESSAGES):
                    logger.error("engine channel %s: unexpected %s; closing it", channel_id, type(msg).__name__)
                    break
                answer = self.on_message(client, msg)
                if answer is not None:
                    self.put(client, *answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the reader closed the channel
        except Exception:
            logger.exception("engine channel %s failed; closing it", channel_id)
        if serving is not None:
            serving.cancel()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
