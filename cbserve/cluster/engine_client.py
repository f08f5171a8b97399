"""The ingress side of the engine replicas: creates the SchedulerActors, watches their health, routes each
request to one (cluster/router.py) and turns its stream into RequestOutput batches or APIErrors.

A request reaches its engine replica, and is aborted or finished there, by a message on the channel the ingress
keeps to that replica (cluster/output_channel.py, engine_messages.py), the channel its outputs come back on:
no Ray call per request. Ray calls are left for the life cycle (health, stats, shutdown).

``request_timeout_s``: a request still running that long after ``generate`` was called is aborted in its
engine (its KV blocks are freed) and ends with APIError 504 (type "timeout"): a non-streamed response is
that error; a streamed one gets it as an error event, then ``[DONE]``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cbserve.cluster.engine_messages import AbortRequest, AddRequest, Admitted, EngineFailure, FinishSequence
from cbserve.cluster.output_channel import ChannelReader
from cbserve.cluster.router import NoHealthyReplicaError, Route, Router
from cbserve.cluster.scheduler_actor import SchedulerActor
from cbserve.config import CBServeConfig
from cbserve.frontend.protocol import APIError
from cbserve.scheduler.kv_events import KVCacheEvents, cache_extra_keys
from cbserve.scheduler.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

NAMESPACE = "cbserve"
HEALTH_PERIOD_S = 0.5
HEALTH_TIMEOUT_S = 5.0
# A request that finds no replica ready (all failed at once, or being rebuilt) waits this long for one, polling.
FAILOVER_WAIT_S = 30.0
FAILOVER_POLL_S = 0.05
MAX_REPLICA_LOSSES = 2  # a request on this many replicas as they were lost is not retried again

_FAILURE_STATUS = {
    "rejected": 400, "duplicate": 400, "queue_full": 429, "unavailable": 503, "aborted": 503, "timeout": 504,
    "internal": 500, "failed": 500,
}
# Failures that say nothing about the request itself (the replica was full, or is gone): another replica may take
# it, before admission or, if none of its tokens came back yet, after.
_TRY_ELSEWHERE = frozenset({"queue_full", "unavailable"})
_FAILURE_TYPE = {
    "rejected": "invalid_request_error",
    "duplicate": "invalid_request_error",
    "queue_full": "rate_limit_exceeded",
    "unavailable": "service_unavailable",
    "aborted": "service_unavailable",
    "timeout": "timeout",
    "failed": "server_error",
}


def engine_actor_name(app_name: str, owner: str, index: int) -> str:
    """Engines belong to one ingress replica (``owner``): a new version of the app, or a second ingress
    replica, builds its own engines instead of adopting (and later killing) another's."""
    return f"{app_name}:{owner}:engine-{index}"


def engine_actor_names(app_name: str) -> list[str]:
    """Names of the live engine actors of an app (all its ingress replicas), in index order."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE and a["name"].startswith(f"{app_name}:")]
    return sorted(names, key=lambda n: (n.rsplit(":", 2)[1], int(n.rsplit("-", 1)[1])))


def failure_to_api_error(failure: EngineFailure) -> APIError:
    status = _FAILURE_STATUS.get(failure.kind, 500)
    return APIError(status, failure.message, _FAILURE_TYPE.get(failure.kind, "internal_error"))


class EngineClient:
    def __init__(self, config: CBServeConfig, app_name: str, owner: str) -> None:
        self.config = config
        self.router = Router(
            config.num_replicas, config.block_size, config.prefix_affinity_tokens,
            config.affinity_max_imbalance_tokens, config.max_cpu_loras or config.max_loras, config.routing,
        )
        # The zero-CPU schedulers live beside the ingress that owns them (they die with it anyway): one
        # network hop less per token, and a lost GPU node never takes a scheduler with it.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        names = [engine_actor_name(app_name, owner, i) for i in range(config.num_replicas)]
        self.engines = [
            SchedulerActor.options(
                name=name,
                namespace=NAMESPACE,
                max_restarts=config.max_restarts,
                max_task_retries=0,
                num_cpus=0,
                max_concurrency=100_000,
                scheduling_strategy=here,
            ).remote(config.model_dump(), str(i), name)
            for i, name in enumerate(names)
        ]
        self.channels = [ChannelReader(engine, owner, self._cache_sink(i)) for i, engine in enumerate(self.engines)]
        self.health: list[dict[str, Any]] = [{"state": "starting"} for _ in self.engines]
        self._routes: dict[str, int] = {}  # req_id -> replica index, while in flight
        self._watcher: asyncio.Task[None] | None = None

    def _cache_sink(self, idx: int) -> Callable[[KVCacheEvents], None]:
        """Where replica ``idx``'s prefix-cache events go: the router's picture of its cache."""
        return lambda events: self.router.apply_cache_events(idx, events)

    # ---- health -------------------------------------------------------------------------------
    def start(self, on_tick: Callable[[], None] | None = None) -> None:
        """Start the health watcher (on the caller's event loop); ``on_tick`` runs every period."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(on_tick))

    async def _watch(self, on_tick: Callable[[], None] | None) -> None:
        while True:
            await self.refresh_health()
            if on_tick is not None:
                on_tick()
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def refresh_health(self) -> None:
        async def one(i: int) -> dict[str, Any]:
            try:
                return await asyncio.wait_for(self.engines[i].health.remote(), HEALTH_TIMEOUT_S)
            except Exception as e:  # actor dead or restarting, or too slow
                return {"replica": str(i), "state": "unreachable", "error": f"{type(e).__name__}"}

        self.health = list(await asyncio.gather(*[one(i) for i in range(len(self.engines))]))
        for i, h in enumerate(self.health):
            self.router.set_healthy(i, h.get("state") == "ready")

    async def wait_started(self, timeout_s: float) -> None:
        """Until every engine replica is ready, or one failed (its error shows in /health), or timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            await self.refresh_health()
            states = [h.get("state") for h in self.health]
            if all(s == "ready" for s in states) or any(s in ("failed", "restarting") for s in states):
                break
            await asyncio.sleep(HEALTH_PERIOD_S)
        logger.info("engine replicas: %s", [h.get("state") for h in self.health])

    @property
    def ready(self) -> bool:
        return all(h.get("state") == "ready" for h in self.health)

    async def stats(self) -> list[dict[str, Any]]:
        async def one(i: int) -> dict[str, Any]:
            try:
                d = await asyncio.wait_for(self.engines[i].stats.remote(), HEALTH_TIMEOUT_S)
            except Exception as e:
                d = {"replica": str(i), "state": "unreachable", "error": f"{type(e).__name__}"}
            r = self.router.replicas[i]
            d.update(routed_requests=r.total_routed, router_outstanding_tokens=r.outstanding_tokens,
                     routed_cache_hits=r.cache_hits, router_cached_blocks=self.router.index.num_blocks(i))
            return d

        return list(await asyncio.gather(*[one(i) for i in range(len(self.engines))]))

    # ---- requests -----------------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncIterator[list[RequestOutput]]:
        """Yields ``[]`` once the engine admitted the request (the front end's admission mark, frontend/serving.py's
        ``Engine``; on the channel it is ``Admitted``), then batches of new outputs. Raises APIError on rejection,
        failure or timeout (``request_timeout_s``). Leaving early (client gone, stop string, timeout) aborts it in
        the engine."""
        timeout_s = self.config.request_timeout_s
        return self._routed(request) if timeout_s is None else self._deadlined(request, timeout_s)

    async def _deadlined(self, request: EngineRequest, timeout_s: float) -> AsyncIterator[list[RequestOutput]]:
        """``_routed`` within ``timeout_s``: a timeout cancels the pending step of the stream, which aborts it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with contextlib.aclosing(self._routed(request)) as stream:
            while True:
                try:
                    item = await asyncio.wait_for(anext(stream), max(0.0, deadline - loop.time()))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    msg = f"the request did not finish within request_timeout_s ({timeout_s:g} s); it was aborted"
                    raise failure_to_api_error(EngineFailure("timeout", msg)) from None
                yield item

    async def _routed(self, request: EngineRequest) -> AsyncIterator[list[RequestOutput]]:
        """``generate`` without a deadline. A replica that turns the request away (waiting queue full, or gone),
        or that fails after admitting it but before any token of it came back (its worker or scheduler died),
        is skipped and the request runs on another replica, unseen by the client. When no replica is ready (both
        failed at once, or all are being rebuilt), the request waits up to ``FAILOVER_WAIT_S`` for one. The
        client sees a 429 when every ready replica is full, a 503 when none comes back in time, and an error
        after tokens were streamed (a retry would repeat them). A request whose own step failed is never retried
        ("failed", "rejected"), and one that was on ``MAX_REPLICA_LOSSES`` replicas as they were lost is failed as
        the suspect it is (a poison that kills its worker would otherwise take down one replica after another)."""
        full: set[int] = set()  # replicas whose waiting queue turned the request away (a gone one is unhealthy)
        admitted = streamed = False
        losses = 0  # replicas lost while they held the request
        lora_id = None if request.lora is None else request.lora.lora_int_id
        extra_keys = cache_extra_keys(request.cache_salt, request.lora)
        deadline = asyncio.get_running_loop().time() + FAILOVER_WAIT_S
        while True:
            route = await self._choose(request, full, lora_id, extra_keys, deadline)
            idx, here = route.replica, False
            async with contextlib.aclosing(self._attempt(route, request)) as stream:
                async for item in stream:
                    if isinstance(item, EngineFailure):
                        if streamed or item.kind not in _TRY_ELSEWHERE:
                            raise failure_to_api_error(item)
                        losses += here and item.kind == "unavailable"
                        if losses >= MAX_REPLICA_LOSSES:
                            logger.error("request %s was on %d engine replicas as they were lost: failed as a suspect, "
                                         "not retried", request.req_id, losses)
                            raise APIError(500, f"the request was running on {losses} engine replicas that were lost; "
                                           "it is not retried again", "server_error")
                        if item.kind == "queue_full":
                            full.add(idx)
                            if not self._another(full):
                                raise failure_to_api_error(item)
                        elif asyncio.get_running_loop().time() >= deadline:  # replicas keep failing it
                            raise failure_to_api_error(item)
                        elif admitted:
                            logger.warning("engine replica %d failed before request %s's first token (%s); "
                                           "running it on another replica", idx, request.req_id, item.message)
                        break
                    if isinstance(item, Admitted):
                        here = True
                        if not admitted:  # not again, by a replica that took the request over
                            admitted = True
                            yield []
                        continue
                    streamed = True  # outputs reached the caller: a retry would repeat them
                    yield item
                else:
                    return

    async def _choose(self, request: EngineRequest, full: set[int], lora_id: int | None, extra_keys: tuple,
                      deadline: float) -> Route:
        """The replica for the next attempt: a ready one that did not turn the request away, waiting until
        ``deadline`` for one to be ready when none is (but not for replicas that failed for good)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return self.router.route(request.prompt_token_ids, full, lora_id, extra_keys)
            except NoHealthyReplicaError as e:
                recoverable = any(h.get("state") != "failed" for h in self.health)
                if full or not recoverable or loop.time() >= deadline:
                    raise APIError(503, f"{e}; retry later", "service_unavailable") from e
            await asyncio.sleep(FAILOVER_POLL_S)

    def _another(self, full: set[int]) -> bool:
        return any(i not in full for i in self.router.healthy_replicas())

    async def _attempt(
        self, route: Route, request: EngineRequest
    ) -> AsyncIterator[Admitted | list[RequestOutput] | EngineFailure]:
        """What the routed replica says about the request: ``Admitted``, then batches of its outputs; ends with an
        EngineFailure item when the replica refuses or fails it. The request goes out, and its items come back, on
        the replica's channel (cluster/output_channel.py), its queue registered before it is sent. The router
        counts its prefill as pending there until its first output."""
        sp = request.sampling_params
        cost = len(request.prompt_token_ids) + sp.num_sequences * (sp.max_tokens or 0)
        idx, prefill = route.replica, route.prefill_tokens
        channel, req_id = self.channels[idx], request.req_id
        self.router.add(idx, cost, None if request.lora is None else request.lora.lora_int_id, prefill)
        self._routes[req_id] = idx
        queue = channel.register(req_id)
        finished = False
        try:
            channel.send(AddRequest(request))
            remaining = sp.n  # sequences not yet finished (best_of: the n kept)
            while remaining > 0:
                outputs: list[RequestOutput] = []
                for item in await queue.get():
                    if isinstance(item, Admitted):
                        yield item
                    elif isinstance(item, EngineFailure):  # refused, or the engine has ended the request itself
                        finished = True
                        if item.kind == "unavailable":
                            self.router.set_healthy(idx, False)
                        if outputs:
                            yield outputs
                        yield item
                        return
                    else:
                        outputs.append(item)
                        remaining -= int(item.finished)
                if outputs:
                    if prefill:  # its first token: the replica's prefill queue is that much shorter
                        self.router.prefilled(idx, prefill)
                        prefill = 0
                    yield outputs
            finished = True
        finally:
            channel.unregister(req_id)
            self.router.prefilled(idx, prefill)
            self.router.done(idx, cost)
            self._routes.pop(req_id, None)
            if not finished:
                channel.tell(AbortRequest(req_id))

    def finish(self, req_id: str, index: int) -> None:
        """A stop string ended sequence ``index``: tell its engine (no answer)."""
        idx = self._routes.get(req_id)
        if idx is not None:
            self.channels[idx].tell(FinishSequence(req_id, index))

    def fail_all(self, message: str) -> None:
        """End every request in flight with ``message`` (a 503, or an error event in a stream), and abort each
        in its engine."""
        failure = EngineFailure("aborted", message)
        for req_id, idx in list(self._routes.items()):
            self.channels[idx].fail(req_id, failure)
            self.channels[idx].tell(AbortRequest(req_id))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Release every replica's workers and placement group, then end the actors (blocking)."""
        if self._watcher is not None:
            self._watcher.cancel()
        for channel in self.channels:
            channel.close()
        with contextlib.suppress(Exception):
            ray.get([e.shutdown.remote() for e in self.engines], timeout=timeout_s)
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine, no_restart=True)
