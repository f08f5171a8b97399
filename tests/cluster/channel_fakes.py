"""A stand-in for a SchedulerActor's channel server (cluster/channel/server.py) speaking the real wire format
(cluster/channel/transport.py, engine_messages.py): the reader's token and ``OpenChannel``, then the reader's messages
into an inbox, and one pickled ``OutputFrame`` per batch the other way (a batch dict is sent without prefix-cache
events; an ``OutputFrame`` as it is). For tests of the ingress end (ChannelReader, EngineClient) without Ray;
the real ChannelServer is tested against the real reader in test_output_channel.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from cbserve.cluster.channel.messages import OpenChannel, OutputFrame
from cbserve.cluster.channel.transport import TOKEN_BYTES, StepAddress, encode, read_message

Inbox = asyncio.Queue[Any]


class FakeChannelServer:
    """Each connection writes the batches ``batches_for(channel_id, inbox)`` yields, then closes (a broken
    channel); a generator that never ends keeps the channel open. ``inbox`` gets the messages the reader
    writes, in order; every message read is also kept in ``received``."""

    def __init__(self, batches_for: Callable[[str, Inbox], AsyncIterator[Any]]) -> None:
        self.batches_for = batches_for
        self.opened: list[str] = []
        self.received: list[Any] = []
        self._server: asyncio.Server | None = None
        self._address: StepAddress | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._readers: set[asyncio.Task[None]] = set()

    async def address(self) -> StepAddress:
        if self._address is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self._address = StepAddress("127.0.0.1", self._server.sockets[0].getsockname()[1], b"t" * TOKEN_BYTES)
        return self._address

    async def close(self) -> None:
        """Stop serving and end every open connection (inside the test's event loop, before it closes): what
        the readers wrote before they closed is read first."""
        if self._server is not None:
            self._server.close()
        if self._readers:
            await asyncio.wait(self._readers, timeout=5)
        for task in self._handlers | self._readers:
            task.cancel()
        await asyncio.gather(*self._handlers, *self._readers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        await reader.readexactly(TOKEN_BYTES)
        hello = await read_message(reader)
        assert isinstance(hello, OpenChannel)
        self.opened.append(hello.channel_id)
        inbox: Inbox = asyncio.Queue()
        self._readers.add(asyncio.ensure_future(self._receive(reader, inbox)))
        try:
            async for batch in self.batches_for(hello.channel_id, inbox):
                writer.write(encode(OutputFrame(batch) if isinstance(batch, dict) else batch))
                await writer.drain()
        finally:
            writer.close()

    async def _receive(self, reader: asyncio.StreamReader, inbox: Inbox) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                msg = await read_message(reader)
                self.received.append(msg)
                inbox.put_nowait(msg)
