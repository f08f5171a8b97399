"""The channel between an ingress replica and an engine replica: one two-way loopback TCP connection per
(ingress replica, engine replica), every request of the one multiplexed on it.

The ingress writes its requests' admissions, aborts and stop-string finishes on it (engine_messages.py:
``AddRequest``, ``AbortRequest``, ``FinishSequence``); the engine answers each AddRequest with ``Admitted`` or
the request's ``EngineFailure`` and sends every step's outputs of all the requests of that ingress replica as
ONE message (``OutputFrame``: req_id -> the items since the last message, and the engine's prefix-cache events
since then, scheduler/kv_events.py, for the cache-aware router). The SchedulerActor runs beside its ingress
(engine_client.py pins it to that node). A Ray actor call would cost the two processes ~1.5 ms of CPU per
message in Ray's threads; a frame on a socket costs ~0.3 ms. Ray calls are left for the life cycle (health,
``output_address``, stats, shutdown).

The engine end (``ChannelServer``, one ``ChannelBuffer`` per channel) hands each message it reads to the
actor (``on_message``, on the actor's event loop) and collects outputs between messages; the actor answers an
AddRequest on the same buffer before any output of the request, so an admission always precedes its outputs.
The ingress end (``ChannelReader``) gets the server's address and token from the actor
(``SchedulerActor.output_address``), opens the channel with the token and ``OpenChannel(channel id)`` (a
connection whose first frame is anything else is closed), writes the messages (queued until it is connected),
reads the frames and hands each request's items to the queue its handler waits on: a request's queue is
registered before its AddRequest is written, so nothing arrives before someone waits for it. When the
connection breaks (the engine actor died or restarted), every request waiting on it, admitted or not yet,
gets an ``EngineFailure("unavailable")``, and the next request opens a fresh channel; when the reader goes
away, the engine aborts the requests it read for. A channel's first frame carries a snapshot of the engine's
prefix cache (``KVCacheEvents.reset``), later frames the changes; when it breaks, the reader's router forgets
that cache. Framing and the token: transport.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from collections.abc import Callable
from typing import Any

from cbserve.cluster.engine_messages import (
    AbortRequest,
    AddRequest,
    Batch,
    EngineFailure,
    FinishSequence,
    IngressMessage,
    Item,
    Items,
    OpenChannel,
    OutputFrame,
)
from cbserve.cluster.transport import (
    HANDSHAKE_TIMEOUT_S,
    StepAddress,
    connect,
    encode,
    new_token,
    no_delay,
    read_message,
    read_token,
)
from cbserve.scheduler.kv_events import KVCacheEvents, KVEventRecorder

logger = logging.getLogger(__name__)

CacheEventsSink = Callable[[KVCacheEvents], None]
MessageHandler = Callable[[str, IngressMessage], None]
_INGRESS_MESSAGES = (AddRequest, AbortRequest, FinishSequence)


class ChannelBuffer:
    """The engine end of one channel: items (and prefix-cache events) wait here until the channel's stream takes
    them."""

    def __init__(self) -> None:
        self.pending: Batch = {}
        self.cache = KVEventRecorder()
        self.ready = asyncio.Event()

    def put_cache_events(self, events: KVCacheEvents) -> None:
        self.cache.add(events)
        self.ready.set()

    def put(self, req_id: str, item: Item) -> None:
        items = self.pending.get(req_id)
        if items is None:
            self.pending[req_id] = [item]
        else:
            items.append(item)
        self.ready.set()

    async def take(self) -> OutputFrame:
        """Everything put since the last take (waits until there is something)."""
        await self.ready.wait()
        batch, self.pending = self.pending, {}
        self.ready.clear()
        return OutputFrame(batch, self.cache.take())


class ChannelServer:
    """The engine end: a loopback TCP server; each connection is one channel (its reader sends the token, then
    ``OpenChannel``, then its messages). ``on_message(channel_id, message)`` gets each message in order;
    ``on_closed(channel_id)`` runs when a reader goes. ``cache_snapshot()``: the event hashes of the engine's prefix
    cache now, sent first on every channel (None, or no callable: the engine reports no prefix-cache events)."""

    def __init__(
        self, on_message: MessageHandler, on_closed: Callable[[str], None],
        cache_snapshot: Callable[[], list[int] | None] | None = None,
    ) -> None:
        self.on_message = on_message
        self.on_closed = on_closed
        self.cache_snapshot = cache_snapshot
        self.connected: set[str] = set()  # channels whose reader is connected
        self.buffers: dict[str, ChannelBuffer] = {}  # channel id -> outputs waiting for its reader
        self.token = new_token()
        self.address: StepAddress | None = None
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1") -> StepAddress:
        if self.address is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
            self.address = StepAddress(host, self._server.sockets[0].getsockname()[1], self.token)
        return self.address

    def buffer(self, channel_id: str) -> ChannelBuffer:
        """The channel's buffer (made when outputs come before its reader connected)."""
        buffer = self.buffers.get(channel_id)
        if buffer is None:
            buffer = self.buffers[channel_id] = ChannelBuffer()
        return buffer

    def put_cache_events(self, events: KVCacheEvents) -> None:
        """The engine's prefix cache changed: every connected channel carries the events with its next frame (one
        that connects later starts with a snapshot)."""
        for channel_id in self.connected:
            self.buffer(channel_id).put_cache_events(events)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel_id = await self._handshake(reader)
        if channel_id is None:
            writer.close()
            return
        no_delay(writer)
        buffer = self.buffer(channel_id)
        snapshot = None if self.cache_snapshot is None else self.cache_snapshot()
        if snapshot is not None:
            buffer.put_cache_events(KVCacheEvents(stored=snapshot, reset=True))
        self.connected.add(channel_id)
        serving = asyncio.current_task()
        receiving = asyncio.ensure_future(self._receive(channel_id, reader, serving))
        try:
            while True:
                writer.write(encode(await buffer.take()))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the reader went away (or the actor is stopping)
        finally:
            receiving.cancel()
            writer.close()
            self.connected.discard(channel_id)
            self.buffers.pop(channel_id, None)
            self.on_closed(channel_id)

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

    async def _receive(self, channel_id: str, reader: asyncio.StreamReader, serving: asyncio.Task[Any] | None) -> None:
        """The reader's messages, handed on in order until it closes the connection; then the channel ends."""
        try:
            while True:
                msg = await read_message(reader)
                if not isinstance(msg, _INGRESS_MESSAGES):
                    logger.error("engine channel %s: unexpected %s; closing it", channel_id, type(msg).__name__)
                    break
                self.on_message(channel_id, msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the reader closed the channel
        except Exception:
            logger.exception("engine channel %s failed; closing it", channel_id)
        if serving is not None:
            serving.cancel()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


class ChannelReader:
    """The ingress end of the channel to one engine replica (``engine``: its actor handle). ``on_cache_events``
    gets the replica's prefix-cache events (a reset to nothing when the channel breaks)."""

    def __init__(self, engine: Any, owner: str, on_cache_events: CacheEventsSink | None = None) -> None:
        self.engine = engine
        self.owner = owner
        self.on_cache_events = on_cache_events
        self.channel_id = ""
        self.queues: dict[str, asyncio.Queue[Items]] = {}
        self._task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None  # once connected
        self._outbox: list[bytes] = []  # frames sent before the connection is up

    @property
    def is_open(self) -> bool:
        return self._task is not None and not self._task.done()

    def open(self) -> str:
        """The channel's id; starts reading (again) when the channel is not open."""
        if not self.is_open:
            self.channel_id = f"{self.owner}:{uuid.uuid4().hex[:12]}"
            self._writer, self._outbox = None, []
            # An empty context: the stream must not count as a child of the HTTP request that opened it,
            # or Serve cancelling that request (client gone) would cancel the channel of every request.
            loop = asyncio.get_running_loop()
            self._task = contextvars.Context().run(loop.create_task, self._read(self.channel_id))
        return self.channel_id

    def register(self, req_id: str) -> asyncio.Queue[Items]:
        queue: asyncio.Queue[Items] = asyncio.Queue()
        self.queues[req_id] = queue
        return queue

    def unregister(self, req_id: str) -> None:
        self.queues.pop(req_id, None)

    def send(self, message: IngressMessage) -> None:
        """Write ``message`` to the engine, opening the channel first when it is not open (an AddRequest: its
        answer comes back on this channel, to the queue registered for the request)."""
        self.open()
        self._write(encode(message))

    def tell(self, message: IngressMessage) -> None:
        """Write ``message`` only when the channel is open (an abort or a finish: when a channel breaks, the engine
        aborts its requests itself, and a new channel would have nothing to end)."""
        if self.is_open:
            self._write(encode(message))

    def _write(self, data: bytes) -> None:
        if self._writer is None:
            self._outbox.append(data)  # written, in order, once connected
            return
        # A connection the engine broke (its actor died) closes before the reader sees it: nothing is written,
        # and the reader, ending, fails every request registered here with "unavailable" (so they run elsewhere).
        with contextlib.suppress(RuntimeError, ConnectionError):
            if not self._writer.is_closing():
                self._writer.write(data)

    def fail(self, req_id: str, failure: EngineFailure) -> None:
        """End request ``req_id`` on this side with ``failure`` (nothing when it is not registered here)."""
        queue = self.queues.get(req_id)
        if queue is not None:
            queue.put_nowait([failure])

    async def _read(self, channel_id: str) -> None:
        why = "its output channel closed"
        writer: asyncio.StreamWriter | None = None
        try:
            address: StepAddress = await self.engine.output_address.remote()
            reader, writer = await connect(address)
            writer.write(b"".join([encode(OpenChannel(channel_id)), *self._outbox]))
            self._writer, self._outbox = writer, []
            while True:
                out: OutputFrame = await read_message(reader)
                if out.cache_events is not None and self.on_cache_events is not None:
                    self.on_cache_events(out.cache_events)  # before the outputs: a request they end may route next
                for req_id, items in out.batch.items():
                    queue = self.queues.get(req_id)
                    if queue is not None:
                        queue.put_nowait(items)
        except asyncio.CancelledError:
            raise
        except asyncio.IncompleteReadError:
            logger.warning("output channel %s to the engine closed", channel_id)
        except Exception as e:  # the engine actor died or was restarted: its requests are gone
            why = f"{type(e).__name__}"
            logger.warning("output channel %s to the engine broke: %s", channel_id, e)
        finally:
            self._writer = None
            if writer is not None:
                writer.close()
        if self.on_cache_events is not None:
            self.on_cache_events(KVCacheEvents(reset=True))  # its cache is unknown until a new channel's snapshot
        failure = EngineFailure("unavailable", f"the engine replica is unavailable ({why}); retry the request")
        for queue in self.queues.values():  # nothing more will come for any of them
            queue.put_nowait([failure])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
