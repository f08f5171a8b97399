"""SchedulerActor: one engine replica. An async Ray actor that owns an EngineCore and the RayExecutor over its ranks
(at tensor-parallel size 1 the one rank runs in this actor, on a model thread of its own: rank.py; larger replicas
have a worker group of WorkerActors), runs the engine's own loop (``EngineCore.step_async``) as an asyncio task and
talks to the ingress replicas over one channel each (output_channel.py: a loopback socket this actor serves). It
reads their requests, aborts and stop-string finishes from it (``_on_message``; an AddRequest is answered there with
``Admitted`` or the refusal's ``EngineFailure``) and sends each step's outputs back on it, each to the channel its
request came on (``EngineRequest.client``: the engine knows every request and where it came from; this actor keeps
no table of its own). Its state ("starting", "ready", "restarting", "failed") goes out on every channel when it
changes. Ray calls only run its life cycle: ``output_address``, ``stats``, ``shutdown``.

All engine state is touched from the actor's event loop only: the engine's turn schedules and applies steps on the
loop (they are cheap) and awaits the workers in between, which is when the channels' messages come in. A step that
raised on a live worker fails its culprits alone (scheduler/fault_isolation.py). When the worker group is lost (a
worker process or node gone), every request in the engine gets an ``EngineFailure`` ("unavailable") and the replica
rebuilds its worker group and engine; the actor itself (with its in-actor rank) is restarted by Ray
(``max_restarts``) if it dies, and the ingress, whose channel to it ended, fails its requests over. A build that
fails on the configuration or the model (a ConfigError, or the workers raising ValueError / FileNotFoundError /
NotImplementedError while loading) is not retried: the replica stays "failed" with that error.

Step timing and counters are the EngineCore's (``update_from_output`` fills the step's stats, ``EngineCore.totals``
counts requests and prefix-cache lookups; each rebuilt engine continues the totals of the one it replaces)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from concurrent.futures import Future
from typing import Any

import ray

from cbserve.cluster.channel.messages import (
    ADMITTED,
    AbortRequest,
    AddRequest,
    Admitted,
    EngineFailure,
    EngineState,
    FinishSequence,
    IngressMessage,
)
from cbserve.cluster.channel.server import ChannelServer
from cbserve.cluster.channel.transport import StepAddress
from cbserve.cluster.engine.ray_executor import RayExecutor, WorkerGroupError
from cbserve.cluster.engine.rollout import Rollout
from cbserve.cluster.ops.metrics import EngineMetrics
from cbserve.cluster.ops.path_trace import PathTrace
from cbserve.config import CBServeConfig, check_kv_capacity
from cbserve.scheduler.engine_core import EngineCore, tune_gc_for_serving
from cbserve.scheduler.errors import DuplicateRequestError, QueueFullError, RequestRejectedError
from cbserve.scheduler.kv.kv_events import KVCacheEvents
from cbserve.scheduler.outputs import ModelRunnerOutput
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput
from cbserve.scheduler.stats import EngineTotals

logger = logging.getLogger(__name__)

REBUILD_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
IDLE_METRICS_PERIOD_S = 1.0  # how often an idle engine re-sets its gauges
BATCHING_WINDOW_PAUSE_S = 0.002  # a step that runs nothing (a batching window is open): pause, do not spin
# Raised while building the engine, these say the configuration or the model is wrong: a rebuild would fail
# the same way (a lost node or actor, or a failed rendezvous, raises something else and is retried).
_CONFIG_ERRORS = (ValueError, FileNotFoundError, NotImplementedError)


async def _wait(future: Future[ModelRunnerOutput] | None) -> None:
    """The engine's wait for a step's output, on this actor's loop (the step's error is the engine's to handle)."""
    if future is None:
        await asyncio.sleep(BATCHING_WINDOW_PAUSE_S)
    else:
        await asyncio.wait([asyncio.wrap_future(future)])


@ray.remote
class SchedulerActor:
    def __init__(self, config: dict[str, Any], replica: str, name: str) -> None:
        self.config = CBServeConfig.model_validate(config)
        self.replica = replica
        self.name = name  # unique in the cluster: names the worker group's placement group
        self.status = EngineState("starting", actor=uuid.uuid4().hex)
        self.engine: EngineCore | None = None
        self.executor: RayExecutor | None = None
        self.outputs = ChannelServer(self._on_message, self._channel_closed, self._snapshot)  # the ingress channels
        self.totals = EngineTotals()  # every engine this replica builds counts on from here
        self.metrics = EngineMetrics(self.config.model_name, replica)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.path = PathTrace()
        self.rollout: Rollout | None = None  # the RL loop's controls over the built engine (rollout.py)

    def _ensure_started(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _set_state(self, state: str, error: str | None = None) -> None:
        """The replica's state, told on every channel."""
        generation = self.status.generation + (state == "ready")
        self.status = EngineState(state, generation, error, self.status.actor)
        self.outputs.put_state(self.status)

    # ---- requests ---------------------------------------------------------------------------
    async def output_address(self) -> StepAddress:
        """Where the ingress replicas open their channels (output_channel.py)."""
        self._ensure_started()
        return await self.outputs.start()

    def _on_message(self, client: int, message: IngressMessage) -> tuple[str, Admitted | EngineFailure] | None:
        """A message read from channel ``client`` (on this actor's event loop). An AddRequest's answer, which the
        channel sends before any output of the request can be: ``Admitted``, or why it was refused."""
        if isinstance(message, AddRequest):
            request = message.request
            request.client = client
            try:
                failure = self._admit(request)
            except Exception as e:  # a bug, not the request: it alone fails, the channel goes on
                logger.exception("admitting request %s failed", request.req_id)
                failure = EngineFailure("internal", f"admitting the request failed: {type(e).__name__}: {e}")
            return request.req_id, ADMITTED if failure is None else failure
        if self.engine is not None and isinstance(message, AbortRequest):
            self.engine.abort_request(message.req_id)  # idempotent; its abort output goes back unheeded
            self._wake()
        elif self.engine is not None and isinstance(message, FinishSequence):
            self.engine.finish_request(message.req_id, message.index, "stop")
        return None

    def _snapshot(self) -> tuple[EngineState, KVCacheEvents | None]:
        """The state, and what the engine's prefix cache and KV tiers hold (event hashes), for a channel that opens."""
        if not self.config.uses_kv_events:
            return self.status, None
        if self.engine is None:
            return self.status, KVCacheEvents(reset=True)
        return self.status, self.engine.scheduler.kv.cache_snapshot()

    def _channel_closed(self, client: int) -> None:
        """Its reader went away (its ingress died or closed it): abort the requests it sent."""
        if self.engine is not None:
            for req_id in [g.req_id for g in self.engine.groups.values() if g.client == client]:
                self.engine.abort_request(req_id)
            self._wake()

    def _admit(self, request: EngineRequest) -> EngineFailure | None:
        if self.status.state != "ready" or self.engine is None:
            why = f": {self.status.error}" if self.status.error else ""
            return EngineFailure("unavailable", f"engine replica {self.replica} is {self.status.state}{why}")
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
        self._wake()
        return None

    # ---- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        attempt = 0
        if ray.get_runtime_context().was_current_actor_reconstructed:  # Ray restarted it: no tight crash loop
            await asyncio.sleep(REBUILD_BACKOFF_S[0])
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
            except Exception as e:  # worker group lost (or its steps keep failing): fail in-flight requests, rebuild
                await self._recover(e, attempt)
                attempt += 1

    async def _recover(self, e: Exception, attempt: int) -> None:
        msg = f"engine replica {self.replica} failed ({e}); it is restarting, retry the request"
        logger.error("%s", msg)
        self._fail_all(msg)
        self._set_state("restarting", str(e))
        await asyncio.to_thread(self._teardown)  # a compiled-graph teardown may block
        await asyncio.sleep(REBUILD_BACKOFF_S[min(attempt, len(REBUILD_BACKOFF_S) - 1)])

    async def _fail_for_good(self, e: Exception) -> None:
        cause = getattr(e, "cause", None) or e
        logger.error("engine replica %s cannot serve this configuration: %s", self.replica, cause)
        self._fail_all(f"engine replica {self.replica} failed: {cause}")
        self._set_state("failed", str(cause))
        await asyncio.to_thread(self._teardown)

    async def _build(self) -> None:
        self.executor = await RayExecutor.create(self.config, self.replica, f"{self.name}:workers")
        self.executor.on_rank_lost = self._wake
        check_kv_capacity(self.config, self.executor.num_blocks, self.config.resolved_device)
        engine_config = self.config.engine_config(self.executor.num_blocks, self.executor.kv_tiers())
        self.engine = EngineCore(engine_config, self.executor, totals=self.totals, kv_events=self.config.uses_kv_events)
        self.rollout = Rollout(self.engine, self.executor, self._wake)
        if self.config.uses_kv_events:  # a new engine's cache is empty: the routers forget the old one's
            self.outputs.put_cache_events(KVCacheEvents(reset=True))
        tune_gc_for_serving()
        self._set_state("ready")
        logger.info("engine replica %s ready (%d KV blocks)", self.replica, self.executor.num_blocks)

    async def _loop(self) -> None:
        """The engine's pipelined loop (``EngineCore.step_async``) on this actor's event loop; each turn's outputs go
        out on their channels."""
        assert self.engine is not None and self.executor is not None and self._wakeup is not None
        engine, executor = self.engine, self.executor
        try:
            while True:
                result = await engine.step_async(_wait)
                if result is None:  # nothing to run
                    if executor.rank_lost:  # found while idle: rebuild now, not on the next request
                        raise WorkerGroupError(f"engine replica {self.replica} lost a worker rank")
                    await self._idle(engine)
                    continue
                if result.kv_events is not None:
                    self.outputs.put_cache_events(result.kv_events)
                self._dispatch(result.outputs)
                ran = result.scheduler_stats.batch_size > 0
                self.metrics.observe_step(result, executor.stats.last_overhead_s if ran else 0.0)
                if engine.scheduler.offload is not None:
                    self.metrics.observe_tiers(engine.scheduler.offload.stats)
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
        put = self.outputs.put
        for out in outputs:
            if out.error is not None:  # its own step failed (scheduler/fault_isolation.py): it alone ends
                put(out.client, out.req_id, EngineFailure("rejected" if out.error.client_error else "failed",
                                                          out.error.message))
            else:
                put(out.client, out.req_id, out)

    def _fail_all(self, message: str) -> None:
        """Every request in the engine ends with ``message`` ("unavailable": the ingress may run it elsewhere)."""
        groups = [] if self.engine is None else list(self.engine.groups.values())
        self.metrics.observe_failed(len(groups))
        for group in groups:
            self.outputs.put(group.client, group.req_id, EngineFailure("unavailable", message))

    def _teardown(self) -> None:
        self.engine = self.rollout = None
        if self.executor is not None:
            try:
                self.executor.shutdown()
            except Exception:
                logger.exception("worker group shutdown failed")
            self.executor = None

    # ---- an RL loop's controls (rollout.py; rl/engines.py calls them on every replica) -----------------
    def _controls(self) -> Rollout:
        if self.rollout is None or self.status.state != "ready":
            raise RuntimeError(f"engine replica {self.replica} is {self.status.state}: no control now")
        return self.rollout

    async def pause(self, mode: str = "keep") -> dict[str, Any]:
        return await self._controls().pause(mode)

    async def resume(self) -> dict[str, Any]:
        return await self._controls().resume()

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: serve with enable_sleep_mode (--enable-sleep-mode)")
        return await self._controls().sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return await self._controls().wake_up(tags)

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return self._controls().reset_prefix_cache()

    async def init_weight_transfer(self, info: Any) -> None:
        """Join a trainer's weight group (rl/weight_sync.py): every rank, as ``info.rank_offset`` + its rank."""
        self._controls()
        assert self.executor is not None
        await self.executor.join_weight_group(info)

    async def update_weights(self, weights: list[Any] | None = None, version: int | None = None) -> dict[str, Any]:
        """New weights: ``[ref]`` (an object-store reference to HF-named tensors, a mapping or pairs) or, when None,
        what the trainer broadcasts on its weight group now."""
        if self.config.kv_disk_path is not None:
            raise ValueError("update_weights with a KV disk tier (kv_disk_path): its files outlive the process and "
                             "would serve KV computed with other weights after a restart")
        return await self._controls().update_weights(weights[0] if weights else None, version)

    async def rollout_state(self) -> dict[str, Any]:
        """The replica's tensor-parallel size and its controls' state, for a trainer."""
        r = self.rollout
        return {"replica": self.replica, "tensor_parallel_size": self.config.tensor_parallel_size,
                "ready": r is not None and self.status.state == "ready", "paused": r is not None and r.is_paused(),
                "sleeping": sorted(r.asleep) if r is not None else [],
                "weights_version": self.engine.weights_version if self.engine is not None else 0}  # fmt: skip

    # ---- introspection ----------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        """State, requests in the engine, the engines' totals (all generations), KV cache and dispatch figures."""
        self._ensure_started()
        s = self.status
        d: dict[str, Any] = {"replica": self.replica, "state": s.state, "generation": s.generation, "error": s.error,
                             "num_in_flight": 0 if self.engine is None else self.engine.get_num_unfinished_requests(),
                             **dataclasses.asdict(self.totals)}  # fmt: skip
        if self.engine is not None and self.executor is not None:
            kv = self.engine.scheduler.kv
            offload = self.engine.scheduler.offload
            if offload is not None:  # the KV tiers' counters (scheduler/kv/offload.py)
                d["kv_tiers"] = dataclasses.asdict(offload.stats)
            d.update(num_kv_blocks=kv.num_blocks, num_free_kv_blocks=kv.num_free_blocks, kv_cache_usage=kv.usage,
                     has_unfinished_requests=self.engine.has_unfinished_requests())
            ds = self.executor.stats
            d.update(compiled_graph=ds.compiled_graph, worker_torch_threads=ds.torch_threads,
                     engine_pids=[os.getpid(), *ds.pids],  # this actor's process, then the workers'
                     worker_cpu=ds.cpu,  # per rank: cpu_ops, the C kernels' ISA level, the start-up probe
                     dispatch_calls=ds.num_calls, dispatch_overhead_ms_mean=1000 * ds.mean_overhead_s)
        return d

    async def shutdown(self) -> None:
        """Stop the loop and release the worker group and its placement group."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._fail_all(f"engine replica {self.replica} is shutting down")
        self._set_state("stopped")
        self._teardown()
        self.outputs.close()

    async def path_trace(self, command: str) -> dict[str, list[str]]:
        """Record the files this actor's event loop runs, and its in-actor rank's model thread from its next step
        ("start"), or stop and return them ("stop"): the request path's check (path_trace.py)."""
        local = self.executor.local if self.executor is not None else None
        rank: dict[str, list[str]] = {}
        if local is not None:
            rank = local.path.command_later(command)
            await asyncio.wrap_future(local.submit(local.path.sync))  # its idle model thread applies it now
        return {**self.path.command(command), **rank}

    async def worker_handles(self) -> list[Any]:
        return list(self.executor.workers) if self.executor is not None else []
