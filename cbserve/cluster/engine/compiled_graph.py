"""The step transport over a Ray compiled graph (``ray.dag``: pre-allocated shared-memory channels, no task
submission per call): ``GraphSteps``, the executor's choice with ``use_compiled_graph`` (CUDA by default; the
other transport is step_channel.py's sockets). Every rank's ``WorkerActor.execute_model`` is one node of the graph;
a step goes in once and each rank's ``StepReply`` comes out.

Its liveness signal is Ray's: one pending ``lifetime`` call per rank, which fails the moment Ray knows the rank is
gone (its process or its node); ``on_lost`` is told once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from cbserve.cluster.channel.messages import StepMessage, StepReply

logger = logging.getLogger(__name__)


class GraphSteps:
    def __init__(self, graph: Any, workers: list[Any], on_lost: Callable[[str], None]) -> None:
        self.graph = graph
        self._watchers = [asyncio.ensure_future(self._when_gone(rank, w.lifetime.remote(), on_lost))
                          for rank, w in enumerate(workers)]  # fmt: skip

    @classmethod
    def build(cls, workers: list[Any], on_lost: Callable[[str], None]) -> GraphSteps | None:
        """The compiled graph over ``workers``; None when Ray cannot build it (the sockets are used instead)."""
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([w.execute_model.bind(inp) for w in workers])
            return cls(dag.experimental_compile(enable_asyncio=True), workers, on_lost)
        except Exception:
            logger.exception("Ray compiled graph unavailable; using the step channel")
            return None

    @staticmethod
    async def _when_gone(rank: int, lifetime: Any, on_lost: Callable[[str], None]) -> None:
        with contextlib.suppress(Exception):  # the rank died (or was killed at shutdown)
            await lifetime
        on_lost(f"worker rank {rank} is gone")

    async def run(self, so: StepMessage) -> list[StepReply]:
        futures = await self.graph.execute_async(so)
        return [await f for f in futures]

    def close(self) -> None:
        for watcher in self._watchers:
            watcher.cancel()
        try:
            self.graph.teardown()
        except Exception:
            logger.debug("compiled graph teardown failed", exc_info=True)
