"""The engine -> ingress output path: one multiplexed channel per (ingress replica, engine replica).

Each iteration the SchedulerActor has new outputs for many requests. Every step's outputs of all the requests
an ingress replica sent travel as ONE message (``Frame``: ``Batch``, req_id -> the items since the last message,
and the engine's prefix-cache events since then, scheduler/kv_events.py, for the cache-aware router) over
one long-lived loopback TCP connection (the SchedulerActor runs beside its ingress: engine_client.py pins it
to that node). A Ray streaming call would cost the two processes ~1.5 ms of CPU per message in Ray's threads;
a frame on a socket costs ~0.3 ms. The engine end (``ChannelServer``, one ``ChannelBuffer`` per channel)
collects items between messages and writes each batch as one pickled frame (step_channel.frame); the ingress
end (``ChannelReader``) gets the server's address and token from the actor
(``SchedulerActor.output_address``), opens the channel with them and its channel id, reads the frames and
hands each request's items to the queue its handler waits on. When the connection breaks (the engine actor
died or restarted), every request waiting on it gets an ``EngineFailure("unavailable")``, and the next
request opens a fresh channel; when the reader goes away, the engine aborts the requests it read for. A channel's
first frame carries a snapshot of the engine's prefix cache (``KVCacheEvents.reset``), later frames the changes;
when it breaks, the reader's router forgets that cache.

Requests are admitted by a plain call (``SchedulerActor.add(request, channel_id)``) after the ingress has
registered the request's queue, so no output can arrive before someone waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import logging
import pickle
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cbserve.cluster.step_channel import (
    HANDSHAKE_TIMEOUT_S,
    TOKEN_BYTES,
    StepAddress,
    dumps,
    frame,
    no_delay,
    read_frame,
)
from cbserve.scheduler.kv_events import KVCacheEvents, KVEventRecorder
from cbserve.scheduler.request import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineFailure:
    """Sent instead of outputs when a request cannot run or stops abnormally.
    kind: "rejected" (400), "queue_full" (429), "duplicate" (400), "unavailable" (503), "aborted" (503),
    "timeout" (504: request_timeout_s passed; the ingress side sets it)."""

    kind: str
    message: str


Items = list[RequestOutput | EngineFailure]
Batch = dict[str, Items]  # req_id -> its items since the previous message, in order
Frame = tuple[Batch, KVCacheEvents | None]  # one message: the outputs, and the prefix-cache changes (None: none)
CacheEventsSink = Callable[[KVCacheEvents], None]


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

    def put(self, req_id: str, item: RequestOutput | EngineFailure) -> None:
        items = self.pending.get(req_id)
        if items is None:
            self.pending[req_id] = [item]
        else:
            items.append(item)
        self.ready.set()

    async def take(self) -> Frame:
        """Everything put since the last take (waits until there is something)."""
        await self.ready.wait()
        batch, self.pending = self.pending, {}
        self.ready.clear()
        return batch, self.cache.take()


class ChannelServer:
    """The engine end: a loopback TCP server; each connection is one channel (its reader sends the token,
    then its channel id as one frame, then only reads). ``on_closed(channel_id)`` runs when a reader goes.
    ``cache_snapshot()``: the event hashes of the engine's prefix cache now, sent first on every channel (None, or
    no callable: the engine reports no prefix-cache events)."""

    def __init__(
        self, on_closed: Callable[[str], None], cache_snapshot: Callable[[], list[int] | None] | None = None
    ) -> None:
        self.on_closed = on_closed
        self.cache_snapshot = cache_snapshot
        self.connected: set[str] = set()  # channels whose reader is connected
        self.buffers: dict[str, ChannelBuffer] = {}  # channel id -> outputs waiting for its reader
        self.token = secrets.token_bytes(TOKEN_BYTES)
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
        watcher = asyncio.ensure_future(self._watch(reader, serving))
        try:
            while True:
                writer.write(frame(dumps(await buffer.take())))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the reader went away (or the actor is stopping)
        finally:
            watcher.cancel()
            writer.close()
            self.connected.discard(channel_id)
            self.buffers.pop(channel_id, None)
            self.on_closed(channel_id)

    async def _handshake(self, reader: asyncio.StreamReader) -> str | None:
        """The channel id of a reader that presents the token, else None (the connection is closed)."""
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HANDSHAKE_TIMEOUT_S)
            if not hmac.compare_digest(token, self.token):
                logger.warning("output channel: refused a connection without the token")
                return None
            return (await asyncio.wait_for(read_frame(reader), HANDSHAKE_TIMEOUT_S)).decode()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, UnicodeDecodeError):
            return None

    async def _watch(self, reader: asyncio.StreamReader, serving: asyncio.Task[Any] | None) -> None:
        """A reader never writes after its channel id: the read ends when it closes the connection."""
        with contextlib.suppress(ConnectionError):
            await reader.read()
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

    def open(self) -> str:
        """The id to send requests with; starts reading (again) when the channel is not open."""
        if self._task is None or self._task.done():
            self.channel_id = f"{self.owner}:{uuid.uuid4().hex[:12]}"
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
            reader, writer = await asyncio.open_connection(address.host, address.port)
            writer.write(address.token + frame(channel_id.encode()))
            while True:
                batch, cache_events = pickle.loads(await read_frame(reader))
                if cache_events is not None and self.on_cache_events is not None:
                    self.on_cache_events(cache_events)  # before the outputs: a request they end may route next
                for req_id, items in batch.items():
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
