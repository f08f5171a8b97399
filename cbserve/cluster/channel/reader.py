"""The ingress end of the channel to one engine replica (the engine end, messages and framing: output_channel.py).

``ChannelReader`` keeps the channel open for the life of the ingress replica: it connects when started (the
actor's ``output_address`` names the server and its token), and again after the channel breaks, with a backoff
(``RECONNECT_S``: a replica whose actor Ray restarts comes back on a new address). It writes the ingress's
messages (``send``: False when the channel is not connected, so the request goes elsewhere at once) and hands
every frame to its ``ChannelSink`` (engine_client.py): the replica's state, its prefix-cache events, each
request's items. The connection ending is the one way the ingress learns that the replica's actor is gone: the
sink is told at once (``broken``), fails the requests it had sent there and stops routing to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, Protocol

from cbserve.cluster.channel.messages import IngressMessage, OpenChannel, OutputFrame
from cbserve.cluster.channel.transport import StepAddress, connect, encode, read_message

logger = logging.getLogger(__name__)

RECONNECT_S = (0.05, 0.25, 1.0, 2.0)  # waits before the next connection attempts after a break


class ChannelSink(Protocol):
    def frame(self, replica: int, frame: OutputFrame) -> None:
        """A frame from the replica, in order."""
        ...

    def broken(self, replica: int, why: str) -> None:
        """The channel ended (the replica's actor is gone, or restarting); nothing more comes on it."""
        ...


class ChannelReader:
    """The channel to engine replica ``replica`` (``engine``: its actor handle); ``owner`` names the ingress."""

    def __init__(self, engine: Any, replica: int, owner: str, sink: ChannelSink) -> None:
        self.engine = engine
        self.replica = replica
        self.owner = owner
        self.sink = sink
        self._writer: asyncio.StreamWriter | None = None  # while connected
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def send(self, message: IngressMessage) -> bool:
        """Write ``message`` to the engine; False (nothing written) when the channel is not connected."""
        if not self.connected:
            return False
        with contextlib.suppress(RuntimeError, ConnectionError):  # a connection closing under us: the reader sees it
            self._writer.write(encode(message))  # type: ignore[union-attr]
            return True
        return False

    async def _run(self) -> None:
        attempt = 0
        while True:
            channel_id = f"{self.owner}:{uuid.uuid4().hex[:12]}"
            why = "its engine actor is not reachable"
            try:
                address: StepAddress = await self.engine.output_address.remote()
                reader, self._writer = await connect(address)
                self._writer.write(encode(OpenChannel(channel_id)))
                attempt = 0
                while True:
                    self.sink.frame(self.replica, await read_message(reader))
            except asyncio.CancelledError:
                raise
            except asyncio.IncompleteReadError:
                why = "its engine actor closed the channel"
            except Exception as e:  # the actor died or is being restarted
                why = f"{type(e).__name__}: {e}"
            finally:
                writer, self._writer = self._writer, None
                if writer is not None:
                    writer.close()
            logger.warning("engine channel %s to replica %d broke (%s)", channel_id, self.replica, why)
            self.sink.broken(self.replica, why)
            await asyncio.sleep(RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)])
            attempt += 1

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
