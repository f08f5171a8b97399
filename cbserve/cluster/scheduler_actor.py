"""SchedulerActor: one engine replica. An async Ray actor that owns an EngineCore and the RayExecutor over
its worker group, runs the iteration loop as an asyncio task and talks to the ingress replicas over one
channel each (cluster/output_channel.py: a loopback socket this actor serves): it reads their requests,
aborts and stop-string finishes from it (``_on_message``; an AddRequest is answered there with ``Admitted``
or the refusal's ``EngineFailure``) and sends each step's new tokens back on it, one message per step. Ray
calls only run its life cycle: ``health``, ``output_address``, ``stats``, ``shutdown``.

All engine state is touched from the actor's event loop only: ``schedule()`` and ``update_from_output()``
run on the loop (they are cheap), and the loop awaits the workers in between, which is when the channels'
messages (new requests, aborts and stop-string finishes) are taken in. When the worker group fails (a worker
actor died), every in-flight request gets an ``EngineFailure`` ("unavailable") and the replica rebuilds its
worker group and engine; the actor itself is restarted by Ray (``max_restarts``) if it dies. A build that
fails on the configuration or the model (a ConfigError, or the workers raising ValueError /
FileNotFoundError / NotImplementedError while loading) is not retried: the replica stays "failed" with that
error.

Step timing and counters are the EngineCore's (``update_from_output`` fills the step's stats,
``EngineCore.totals`` counts requests and prefix-cache lookups; each rebuilt engine continues the totals
of the one it replaces); the actor keeps none of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray

from cbserve.cluster.engine_messages import (
    ADMITTED,
    AbortRequest,
    AddRequest,
    EngineFailure,
    FinishSequence,
    IngressMessage,
)
from cbserve.cluster.metrics import EngineMetrics
from cbserve.cluster.output_channel import ChannelServer
from cbserve.cluster.ray_executor import RayExecutor, WorkerGroupError
from cbserve.cluster.transport import StepAddress
from cbserve.config import CBServeConfig, check_kv_capacity
from cbserve.scheduler.engine_core import EngineCore, tune_gc_for_serving
from cbserve.scheduler.errors import DuplicateRequestError, QueueFullError, RequestRejectedError, StepFailedError
from cbserve.scheduler.kv_events import KVCacheEvents
from cbserve.scheduler.request import EngineRequest, RequestOutput
from cbserve.scheduler.stats import EngineTotals

logger = logging.getLogger(__name__)

REBUILD_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
IDLE_METRICS_PERIOD_S = 1.0  # how often an idle engine re-sets its gauges
# Raised while building the engine, these say the configuration or the model is wrong: a rebuild would fail
# the same way (a lost node or actor, or a failed rendezvous, raises something else and is retried).
_CONFIG_ERRORS = (ValueError, FileNotFoundError, NotImplementedError)


@dataclass
class _InFlight:
    channel: str  # the output channel its outputs go to
    generation: int
    outstanding_tokens: int
    remaining: int  # sequences not yet reported finished (best_of: the n kept)


@ray.remote
class SchedulerActor:
    def __init__(self, config: dict[str, Any], replica: str, name: str) -> None:
        self.config = CBServeConfig.model_validate(config)
        self.replica = replica
        self.name = name  # unique in the cluster: names the worker group's placement group
        self.state = "starting"  # starting | ready | restarting | failed
        self.error: str | None = None
        self.generation = 0  # bumps every time the worker group is rebuilt
        self.engine: EngineCore | None = None
        self.executor: RayExecutor | None = None
        self.requests: dict[str, _InFlight] = {}
        # the ingress replicas' output channels; with a cache-aware router they carry the prefix-cache events too
        self.outputs = ChannelServer(
            self._on_message, self._channel_closed, self._cache_snapshot if self.config.uses_kv_events else None
        )
        self.totals = EngineTotals()  # every engine this replica builds counts on from here
        self.metrics = EngineMetrics(self.config.model_name, replica)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def _ensure_started(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ---- requests ---------------------------------------------------------------------------
    async def output_address(self) -> StepAddress:
        """Where the ingress replicas open their channels (cluster/output_channel.py): each sends its requests,
        aborts and finishes on its channel and reads, per step, the new outputs of its requests."""
        self._ensure_started()
        return await self.outputs.start()

    def _on_message(self, channel: str, message: IngressMessage) -> None:
        """A message read from ``channel`` (on this actor's event loop). An AddRequest is answered on the channel
        before any output of the request can be: ``Admitted``, or why it was refused."""
        if isinstance(message, AddRequest):
            request = message.request
            try:
                failure = self._admit(request, channel)
            except Exception as e:  # a bug, not the request: it alone fails, the channel goes on
                logger.exception("admitting request %s failed", request.req_id)
                failure = EngineFailure("internal", f"admitting the request failed: {type(e).__name__}: {e}")
            self.outputs.buffer(channel).put(request.req_id, ADMITTED if failure is None else failure)
        elif isinstance(message, AbortRequest):
            self._abort_request(message.req_id)
        elif isinstance(message, FinishSequence):
            self._finish(message.req_id, message.index)

    def _cache_snapshot(self) -> list[int]:
        """What the engine's prefix cache holds now (event hashes), for a channel that opens."""
        return [] if self.engine is None else self.engine.scheduler.kv.cached_event_hashes()

    def _channel_closed(self, channel: str) -> None:
        """Its reader went away (its ingress died or closed it): abort the requests it was reading for."""
        for req_id in [r for r, e in self.requests.items() if e.channel == channel]:
            self._abort(req_id, self.requests.pop(req_id).generation)

    def _admit(self, request: EngineRequest, channel: str) -> EngineFailure | None:
        if self.state != "ready" or self.engine is None:
            why = f": {self.error}" if self.error else ""
            return EngineFailure("unavailable", f"engine replica {self.replica} is {self.state}{why}")
        request.arrival_time = time.monotonic()  # the ingress clock may be on another node
        try:
            self.engine.add_request(request)
        except QueueFullError as e:
            self.metrics.observe_rejected("queue_full")
            return EngineFailure("queue_full", str(e))
        except DuplicateRequestError as e:
            return EngineFailure("duplicate", str(e))
        except RequestRejectedError as e:
            self.metrics.observe_rejected("rejected")
            return EngineFailure("rejected", str(e))
        sp = request.sampling_params
        max_tokens = sp.max_tokens or self.config.max_model_len - len(request.prompt_token_ids)
        outstanding = len(request.prompt_token_ids) + sp.num_sequences * max_tokens
        self.requests[request.req_id] = _InFlight(channel, self.generation, outstanding, sp.n)
        self._wake()
        return None

    def _send(self, req_id: str, entry: _InFlight, item: RequestOutput | EngineFailure) -> None:
        self.outputs.buffer(entry.channel).put(req_id, item)

    def _abort_request(self, req_id: str) -> None:
        """Idempotent: frees the request's blocks; its stream ends."""
        self._abort(req_id, self.generation)
        entry = self.requests.pop(req_id, None)
        if entry is not None:
            self._send(req_id, entry, EngineFailure("aborted", "request aborted"))

    def _abort(self, req_id: str, generation: int) -> None:
        if self.engine is not None and generation == self.generation:
            self.engine.abort_request(req_id)
            self._wake()

    def _finish(self, req_id: str, index: int) -> None:
        """A stop string was seen by the ingress: finish that sequence (reason "stop")."""
        entry = self.requests.get(req_id)
        if self.engine is not None and entry is not None and entry.generation == self.generation:
            self.engine.finish_request(req_id, index, "stop")

    # ---- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                await self._build()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if isinstance(getattr(e, "cause", None) or e, _CONFIG_ERRORS):
                    await self._fail_for_good(e)
                    return
                await self._recover(e, attempt)
                attempt += 1
                continue
            attempt = 0
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # worker group failure: fail in-flight requests, rebuild
                await self._recover(e, attempt)
                attempt += 1

    async def _recover(self, e: Exception, attempt: int) -> None:
        msg = f"engine replica {self.replica} failed ({e}); it is restarting, retry the request"
        logger.error("%s", msg)
        self.state, self.error = "restarting", str(e)
        self._fail_all(msg)
        await asyncio.to_thread(self._teardown)  # a compiled-graph teardown may block
        await asyncio.sleep(REBUILD_BACKOFF_S[min(attempt, len(REBUILD_BACKOFF_S) - 1)])

    async def _fail_for_good(self, e: Exception) -> None:
        cause = getattr(e, "cause", None) or e
        logger.error("engine replica %s cannot serve this configuration: %s", self.replica, cause)
        self.state, self.error = "failed", str(cause)
        self._fail_all(f"engine replica {self.replica} failed: {cause}")
        await asyncio.to_thread(self._teardown)

    async def _build(self) -> None:
        self.generation += 1
        self.executor = await RayExecutor.create(self.config, self.replica, f"{self.name}:workers")
        self.executor.on_rank_lost = self._wake
        check_kv_capacity(self.config, self.executor.num_blocks, self.config.resolved_device)
        engine_config = self.config.engine_config(self.executor.num_blocks)
        self.engine = EngineCore(engine_config, self.executor, totals=self.totals, kv_events=self.config.uses_kv_events)
        if self.config.uses_kv_events:  # a new engine's cache is empty: the routers forget the old one's
            self.outputs.put_cache_events(KVCacheEvents(reset=True))
        tune_gc_for_serving()
        self.state, self.error = "ready", None
        logger.info("engine replica %s ready (%d KV blocks)", self.replica, self.executor.num_blocks)

    async def _loop(self) -> None:
        """The engine's pipelined loop (``EngineCore.step_with_batch_queue``) on this actor's event loop: the
        engine sends what it can, the oldest step's output is awaited (adds, aborts and stop-string finishes
        come in on the channels meanwhile), applied and streamed out."""
        assert self.engine is not None and self.executor is not None and self._wakeup is not None
        engine, executor = self.engine, self.executor
        try:
            while True:
                if not engine.has_work():
                    if executor.rank_lost:  # found while idle: rebuild now, not on the next request
                        raise WorkerGroupError(f"engine replica {self.replica} lost a worker rank")
                    await self._idle(engine)
                    continue
                engine.submit_steps()
                oldest = engine.oldest_step()
                if oldest is None:
                    continue
                so, future = oldest
                if so.is_empty and len(engine.batch_queue) == 1:
                    await asyncio.sleep(0.002)  # nothing runs: let a batching window fill without spinning
                else:
                    with contextlib.suppress(StepFailedError):  # the engine fails the culprits (next line)
                        await asyncio.wrap_future(future)
                result = engine.complete_oldest_step()
                if result.kv_events is not None:
                    self.outputs.put_cache_events(result.kv_events)
                self._dispatch(result.outputs)
                self.metrics.observe_step(result, 0.0 if so.is_empty else executor.stats.last_overhead_s)
                await asyncio.sleep(0)  # let the channels' messages in
        finally:
            engine.cancel_steps()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _idle(self, engine: EngineCore) -> None:
        assert self._wakeup is not None
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), IDLE_METRICS_PERIOD_S)
        except asyncio.TimeoutError:
            self.metrics.observe_idle(engine.current_stats())

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        requests = self.requests
        for out in outputs:
            entry = requests.get(out.req_id)
            if entry is None:
                continue
            if out.error is not None:  # its own step failed (scheduler/fault_isolation.py): it alone ends
                kind = "rejected" if out.error.client_error else "failed"
                self._send(out.req_id, entry, EngineFailure(kind, out.error.message))
                del requests[out.req_id]
                continue
            self._send(out.req_id, entry, out)
            if out.finished:
                entry.remaining -= 1
                if entry.remaining <= 0:
                    del requests[out.req_id]

    def _fail_all(self, message: str) -> None:
        self.metrics.observe_failed(len(self.requests))
        for req_id, entry in self.requests.items():
            self._send(req_id, entry, EngineFailure("unavailable", message))
        self.requests.clear()

    def _teardown(self) -> None:
        self.engine = None
        if self.executor is not None:
            try:
                self.executor.shutdown()
            except Exception:
                logger.exception("worker group shutdown failed")
            self.executor = None

    # ---- introspection ----------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        self._ensure_started()
        return {
            "replica": self.replica, "state": self.state, "generation": self.generation, "error": self.error
        }

    async def stats(self) -> dict[str, Any]:
        """State, in-flight requests, the engines' totals (all generations), KV cache and dispatch figures."""
        self._ensure_started()
        d: dict[str, Any] = {
            "replica": self.replica,
            "state": self.state,
            "generation": self.generation,
            "error": self.error,
            "num_in_flight": len(self.requests),
            "outstanding_tokens": sum(e.outstanding_tokens for e in self.requests.values()),
            **dataclasses.asdict(self.totals),
        }
        if self.engine is not None and self.executor is not None:
            kv = self.engine.scheduler.kv
            d["num_kv_blocks"] = kv.num_blocks
            d["num_free_kv_blocks"] = kv.num_free_blocks
            d["kv_cache_usage"] = kv.usage
            d["num_unfinished_requests"] = self.engine.get_num_unfinished_requests()
            d["has_unfinished_requests"] = self.engine.has_unfinished_requests()
            ds = self.executor.stats
            d["compiled_graph"] = ds.compiled_graph
            d["worker_torch_threads"] = ds.torch_threads
            d["engine_pids"] = [os.getpid(), *ds.pids]  # this actor's process, then the workers'
            d["worker_cpu"] = ds.cpu  # per rank: cpu_ops, the C kernels' ISA level, the start-up probe
            d["dispatch_calls"] = ds.num_calls
            d["dispatch_overhead_ms_mean"] = 1000 * ds.mean_overhead_s
        return d

    async def shutdown(self) -> None:
        """Stop the loop and release the worker group and its placement group."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._fail_all(f"engine replica {self.replica} is shutting down")
        self._teardown()
        self.outputs.close()
        self.state = "stopped"

    async def worker_handles(self) -> list[Any]:
        return list(self.executor.workers) if self.executor is not None else []
