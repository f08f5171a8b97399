"""The ingress side of the engine replicas: creates the SchedulerActors, keeps one channel open to each
(channel_reader.py), knows their states from it, and sends each request to one of them (``add``: failover.py
routes it, waits for its admission and streams its outputs).

The front end's ``OutputProcessor.requests`` is the ingress's one registry of requests: each ``RequestState`` holds
its output queue, its replica and its routed cost, and every frame a replica sends is handed to the states of that
replica's requests here (``frame``). A replica's state ("ready", "restarting", ...) comes on its channel too; when
the channel breaks (the actor's process is gone) the requests sent there get "unavailable" at once (``broken``),
and failover.py runs them elsewhere when it may. Ray calls are left for the life cycle (stats, shutdown): no
request and no health check is a Ray call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cbserve.cluster.channel.messages import AbortRequest, EngineFailure, EngineState, FinishSequence, OutputFrame
from cbserve.cluster.channel.reader import ChannelReader
from cbserve.cluster.engine.scheduler_actor import SchedulerActor
from cbserve.cluster.ingress.disaggregation import Disaggregation
from cbserve.cluster.ingress.failover import RoutedRequest
from cbserve.cluster.ingress.router import Router
from cbserve.cluster.ops.names import NAMESPACE, engine_actor_name
from cbserve.config import CBServeConfig
from cbserve.config.pd_config import config_for_replica
from cbserve.frontend.output import RequestState
from cbserve.scheduler.kv.kv_events import KVCacheEvents
from cbserve.scheduler.requests.request import RequestOutput

logger = logging.getLogger(__name__)

TICK_S = 0.5  # how often the ingress's periodic work runs (its gauges, routing counters, the LoRA store's pull)
STATS_TIMEOUT_S = 5.0


class EngineClient:
    """``requests``: the front end's registry (``OutputProcessor.requests``)."""

    def __init__(self, config: CBServeConfig, app_name: str, owner: str,
                 requests: Mapping[str, RequestState]) -> None:
        self.config = config
        self.requests = requests
        self.router = Router(
            config.num_replicas, config.block_size, config.prefix_affinity_tokens,
            config.affinity_max_imbalance_tokens, config.max_cpu_loras or config.max_loras, config.routing,
        )
        pd = config.disaggregation
        self.pd = Disaggregation(pd, self.router) if pd is not None and pd.layout else None  # a P:D app's policy
        names = [engine_actor_name(app_name, owner, i) for i in range(config.num_replicas)]
        self.engines = [
            SchedulerActor.options(name=name, namespace=NAMESPACE, max_restarts=config.max_restarts,
                                   max_task_retries=0, max_concurrency=100_000, **engine_placement(config))
            .remote(config_for_replica(config, i).model_dump(), str(i), name)
            for i, name in enumerate(names)
        ]  # fmt: skip
        self.readers = [ChannelReader(engine, i, owner, self) for i, engine in enumerate(self.engines)]
        self.health: list[dict[str, Any]] = [{"replica": str(i), "state": "starting"} for i in range(len(names))]
        self._actors = [("", 0)] * len(names)  # per replica: its actor's life (EngineState.actor), builds before it
        self._changed: asyncio.Event | None = None
        self._ticker: asyncio.Task[None] | None = None

    # ---- the channels' frames ---------------------------------------------------------------------
    def frame(self, replica: int, frame: OutputFrame) -> None:
        """A replica's frame: its state, its prefix-cache events (before the outputs: a request they end may route
        next), then each request's items, to that request's queue."""
        if frame.state is not None:
            self._set_state(replica, frame.state)
        if frame.cache_events is not None:
            self.router.apply_cache_events(replica, frame.cache_events)
        requests = self.requests
        for req_id, items in frame.batch.items():
            state = requests.get(req_id)
            if state is not None and state.replica == replica and state.queue is not None:
                for item in items:
                    state.queue.put_nowait(item)

    def broken(self, replica: int, why: str) -> None:
        """The replica's channel ended: nothing more comes for its requests, and its cache is unknown."""
        self._set_state(replica, EngineState("unreachable", error=why))
        self.router.apply_cache_events(replica, KVCacheEvents(reset=True))
        failure = EngineFailure("unavailable", f"engine replica {replica} is unavailable ({why}); retry the request")
        for state in list(self.requests.values()):
            if state.replica == replica and state.queue is not None:
                state.queue.put_nowait(failure)

    def _set_state(self, replica: int, s: EngineState) -> None:
        """The replica's state as /health and /stats show it; its ``generation`` counts its builds across the
        restarts of its actor (``EngineState.actor``; a state this side sets names no actor and keeps the count)."""
        generation = self.health[replica].get("generation", 0)
        if s.actor:
            actor, base = self._actors[replica]
            if s.actor != actor:  # a new life of the actor (Ray restarted it): its builds count on from here
                base = generation if actor else 0
                self._actors[replica] = (s.actor, base)
            generation = base + s.generation
        self.health[replica] = {"replica": str(replica), "state": s.state, "generation": generation, "error": s.error}
        self.router.set_healthy(replica, s.state == "ready")
        if self._changed is not None:
            self._changed.set()

    # ---- life cycle -------------------------------------------------------------------------------
    def start(self, on_tick: Callable[[], None] | None = None) -> None:
        """Open the channels (on the caller's event loop); ``on_tick`` runs every ``TICK_S``."""
        self._changed = asyncio.Event()
        for reader in self.readers:
            reader.start()
        if on_tick is not None and self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick(on_tick))

    async def _tick(self, on_tick: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            on_tick()

    async def wait_started(self, timeout_s: float) -> None:
        """Until every engine replica is ready, or one failed (its error shows in /health), or timeout."""
        assert self._changed is not None, "start() first"
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            states = [h["state"] for h in self.health]
            left = deadline - asyncio.get_running_loop().time()
            if all(s == "ready" for s in states) or any(s in ("failed", "restarting") for s in states) or left <= 0:
                break
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        logger.info("engine replicas: %s", [h["state"] for h in self.health])

    @property
    def ready(self) -> bool:
        return all(h["state"] == "ready" for h in self.health)

    def recoverable(self) -> bool:
        """Whether some replica may still become ready (not all failed for good)."""
        return any(h["state"] != "failed" for h in self.health)

    async def stats(self) -> list[dict[str, Any]]:
        async def one(i: int) -> dict[str, Any]:
            known = self.health[i]
            if known["state"] == "unreachable":  # its channel is down (seen at once): a call would wait for its actor
                d = {"replica": str(i), "state": "unreachable", "error": known.get("error")}
            else:
                try:
                    d = await asyncio.wait_for(self.engines[i].stats.remote(), STATS_TIMEOUT_S)
                except Exception as e:
                    d = {"replica": str(i), "state": "unreachable", "error": f"{type(e).__name__}"}
            r = self.router.replicas[i]
            d["generation"] = known.get("generation", 0)  # its builds across its actor's restarts
            d.update(routed_requests=r.total_routed, router_outstanding_tokens=r.outstanding_tokens,
                     routed_cache_hits=r.cache_hits, router_cached_blocks=self.router.index.num_blocks(i))
            return d

        return list(await asyncio.gather(*[one(i) for i in range(len(self.engines))]))

    # ---- requests ---------------------------------------------------------------------------------
    async def add(self, state: RequestState) -> AsyncIterator[list[RequestOutput]]:
        """Send the request (registered in ``requests``) and wait until an engine replica admitted it (APIError when
        none will); then its outputs in batches (failover.py). Leaving them early aborts the request."""
        return await RoutedRequest.start(self, state, self.config.request_timeout_s)

    def finish(self, req_id: str, index: int) -> None:
        """A stop string ended sequence ``index``: tell its engine (no answer)."""
        state = self.requests.get(req_id)
        if state is not None and state.replica is not None:
            self.readers[state.replica].send(FinishSequence(req_id, index))

    def fail_all(self, message: str) -> None:
        """End every request in flight with ``message`` (a 503, or an error event in a stream; leaving their streams
        aborts them in their engines)."""
        failure = EngineFailure("aborted", message)
        for state in list(self.requests.values()):
            if state.replica is not None and state.queue is not None:
                state.queue.put_nowait(failure)
                self.readers[state.replica].send(AbortRequest(state.request.req_id))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Release every replica's workers and placement group, then end the actors (blocking)."""
        if self._ticker is not None:
            self._ticker.cancel()
        for reader in self.readers:
            reader.close()
        with contextlib.suppress(Exception):
            ray.get([e.shutdown.remote() for e in self.engines], timeout=timeout_s)
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine, no_restart=True)


def engine_placement(config: CBServeConfig) -> dict[str, Any]:
    """Where an engine replica's SchedulerActor runs. A replica of one rank runs that rank in the actor itself
    (cluster/engine/rank.py), so the actor takes the rank's resources (``worker_num_cpus``, a GPU on CUDA), on this
    ingress's node when it has them. A larger replica's scheduler takes no CPU and lives beside the ingress that
    owns it (it dies with it anyway): one network hop less per token, and a lost GPU node never takes a scheduler
    with it; its ranks are WorkerActors in a placement group of their own."""
    here = ray.get_runtime_context().get_node_id()
    if config.tensor_parallel_size > 1:
        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False)}
    gpu = config.resolved_device == "cuda"
    return {"num_cpus": config.worker_num_cpus, "num_gpus": 1 if gpu else 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=True)}
