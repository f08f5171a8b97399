"""A stand-in for a SchedulerActor's output-channel server (cluster/output_channel.py) speaking the real wire
format: the reader's token and channel id, then one pickled frame per batch (a batch dict is sent without
prefix-cache events; a ``(batch, KVCacheEvents)`` tuple as it is). For tests of the ingress end
(ChannelReader, EngineClient) without Ray; the real ChannelServer is tested against the real reader in
test_output_channel.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from cbserve.cluster.step_channel import TOKEN_BYTES, StepAddress, dumps, frame, read_frame


class FakeChannelServer:
    """Each connection writes the batches ``batches_for(channel_id)`` yields, then closes (a broken
    channel); a generator that never ends keeps the channel open."""

    def __init__(self, batches_for: Callable[[str], AsyncIterator[Any]]) -> None:
        self.batches_for = batches_for
        self.opened: list[str] = []
        self._server: asyncio.Server | None = None
        self._address: StepAddress | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def address(self) -> StepAddress:
        if self._address is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self._address = StepAddress("127.0.0.1", self._server.sockets[0].getsockname()[1], b"t" * TOKEN_BYTES)
        return self._address

    async def close(self) -> None:
        """Stop serving and end every open connection (inside the test's event loop, before it closes)."""
        if self._server is not None:
            self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        await reader.readexactly(TOKEN_BYTES)
        channel_id = (await read_frame(reader)).decode()
        self.opened.append(channel_id)
        try:
            async for batch in self.batches_for(channel_id):
                writer.write(frame(dumps((batch, None) if isinstance(batch, dict) else batch)))
                await writer.drain()
        finally:
            writer.close()
