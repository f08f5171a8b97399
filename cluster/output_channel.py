"""The engine -> ingress output path: one multiplexed channel per (ingress replica, engine replica).

Each iteration the SchedulerActor has new outputs for many requests. Instead of one Ray streaming object per
request per step, every step's outputs of all the requests an ingress replica sent travel as ONE message
(``Batch``: req_id -> the items since the last message) over one long-lived streaming call
(``SchedulerActor.output_channel``). The engine end (``ChannelBuffer``) collects items between messages; the
ingress end (``ChannelReader``) reads the stream and hands each request's items to the queue its handler
waits on. When the stream breaks (the engine actor died or restarted), every request waiting on it gets an
``EngineFailure("unavailable")``, and the next request opens a fresh channel.

Requests are admitted by a plain call (``SchedulerActor.add(request, channel_id)``) after the ingress has
registered the request's queue, so no output can arrive before someone waits for it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from dataclasses import dataclass
from typing import Any

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


class ChannelBuffer:
    """The engine end of one channel: items wait here until the channel's stream takes them."""

    def __init__(self) -> None:
        self.pending: Batch = {}
        self.ready = asyncio.Event()

    def put(self, req_id: str, item: RequestOutput | EngineFailure) -> None:
        items = self.pending.get(req_id)
        if items is None:
            self.pending[req_id] = [item]
        else:
            items.append(item)
        self.ready.set()

    async def take(self) -> Batch:
        """Everything put since the last take (waits until there is something)."""
        await self.ready.wait()
        batch, self.pending = self.pending, {}
        self.ready.clear()
        return batch


class ChannelReader:
    """The ingress end of the channel to one engine replica (``engine``: its actor handle)."""

    def __init__(self, engine: Any, owner: str) -> None:
        self.engine = engine
        self.owner = owner
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

    async def _read(self, channel_id: str) -> None:
        why = "its output channel closed"
        try:
            async for ref in self.engine.output_channel.remote(channel_id):
                batch: Batch = await ref
                for req_id, items in batch.items():
                    queue = self.queues.get(req_id)
                    if queue is not None:
                        queue.put_nowait(items)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine actor died or was restarted: its requests are gone
            why = f"{type(e).__name__}"
            logger.warning("output channel %s to the engine broke: %s", channel_id, e)
        failure = EngineFailure("unavailable", f"the engine replica is unavailable ({why}); retry the request")
        for queue in self.queues.values():  # nothing more will come for any of them
            queue.put_nowait([failure])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
