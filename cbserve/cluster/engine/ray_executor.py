"""RayExecutor: the scheduler's Executor over one replica's ranks: at tensor-parallel size 1 the one rank in this
process (rank.py: ``LocalSteps``, vLLM's ``UniProcExecutor``), else one WorkerActor per rank.

Every rank gets each SchedulerOutput and answers a ``StepReply`` (channel/messages.py); rank 0's output is used.
The hop is one of three step transports behind one interface (``StepTransport``): the in-process model thread at
size 1; else a Ray compiled graph (compiled_graph.py) when ``use_compiled_graph`` (CUDA by default), or one socket
per rank (channel/steps.py: no Ray task per step, no busy wait; a compiled graph that fails to build falls back to
it). ``dispatch overhead`` = wall time of one execute minus the rank-reported forward time: what the hop costs per
iteration.

Two kinds of failure, kept apart. A step that raised on a live rank comes back as its ``StepFailedError`` (a
reply like any other): the engine fails the requests to blame and goes on (scheduler/fault_isolation.py). A worker
rank that is gone (its process or node) breaks the group: the pending step and every later one fail with
``WorkerGroupError`` and the replica rebuilds. A gone rank is noticed once, by its transport's one signal: the
socket (end of file at once when the process dies; TCP keepalive within ``transport.KEEPALIVE_S`` when its node
vanishes), or, with a compiled graph, Ray's actor death. The in-process rank dies with this actor, which Ray
restarts and the ingress notices on its channel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cbserve.cluster.channel.messages import RankCall, StepMessage, StepReply
from cbserve.cluster.channel.steps import SocketSteps
from cbserve.cluster.engine.compiled_graph import GraphSteps
from cbserve.cluster.engine.rank import LocalSteps, Rank
from cbserve.cluster.engine.worker_actor import WorkerActor
from cbserve.config import CBServeConfig
from cbserve.scheduler.config import OffloadConfig
from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerGroupError(RuntimeError):
    """A worker rank is gone or the hop to it broke: the replica must be rebuilt."""


class StepTransport(Protocol):
    """How a replica's steps reach its ranks: ``run`` sends one to every rank and returns their replies, in rank
    order; the transport tells its executor once when a rank is gone (the ``on_lost`` it was built with)."""

    async def run(self, so: StepMessage) -> list[StepReply]: ...

    def close(self) -> None: ...


@dataclass
class DispatchStats:
    compiled_graph: bool = False
    num_calls: int = 0
    total_overhead_s: float = 0.0
    last_overhead_s: float = 0.0
    torch_threads: list[int] = field(default_factory=list)  # per rank, as the workers report them
    pids: list[int] = field(default_factory=list)  # per rank: the worker processes (cluster/ops/cpu_priority.py)
    cpu: list[dict[str, Any] | None] = field(default_factory=list)  # per rank: CPU ops, ISA level, probe

    def observe(self, overhead_s: float) -> None:
        self.num_calls += 1
        self.total_overhead_s += overhead_s
        self.last_overhead_s = overhead_s

    @property
    def mean_overhead_s(self) -> float:
        return self.total_overhead_s / self.num_calls if self.num_calls else 0.0


class RayExecutor:
    """Built with ``await RayExecutor.create(config, replica, pg_name)`` (loads the model on every rank)."""

    def __init__(self, workers: list[Any], pg: Any, num_blocks: int, local: Rank | None = None) -> None:
        self.workers = workers
        self.local = local  # a replica of one rank: it runs here (rank.py), ``workers`` is empty
        self.pg = pg
        self.num_blocks = num_blocks
        self.stats = DispatchStats()
        self.transport: StepTransport | None = None
        self._lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # why the group broke
        self._closing = False
        self.on_rank_lost: Callable[[], None] | None = None  # called once when a rank is gone (the engine loop)
        self._last_done = 0.0  # perf_counter() when the last step's output came back
        self.kv_source: Any = None  # a producer's KVSource (kv_source.py), killed with this executor

    @property
    def rank_lost(self) -> bool:
        """A rank is gone: the group is broken, even while it is idle."""
        return self._lost.done()

    @classmethod
    async def create(cls, config: CBServeConfig, replica: str, pg_name: str) -> RayExecutor:
        """``pg_name`` is unique per replica: a group left behind by a crashed predecessor is removed."""
        if config.tensor_parallel_size == 1:
            return await cls._create_local(config, replica)
        workers, pg = await _start_workers(config, replica, pg_name)
        try:
            addr, port = await workers[0].node_ip_and_free_port.remote()
            await asyncio.gather(*[w.init_distributed.remote(addr, port) for w in workers])
            blocks = await asyncio.gather(*[w.load_model.remote() for w in workers])
            num_blocks = min(int(b) for b in blocks)
            await asyncio.gather(*[w.init_kv_cache.remote(num_blocks) for w in workers])
            pings = await asyncio.gather(*[w.ping.remote() for w in workers])
        except BaseException:
            remove_placement_group(pg)
            raise
        executor = cls(workers, pg, num_blocks)
        executor.stats.torch_threads = [p["torch_threads"] for p in pings]
        executor.stats.pids = [p["pid"] for p in pings]
        executor.stats.cpu = [p["cpu"] for p in pings]
        if config.compiled_graph:
            executor.transport = GraphSteps.build(workers, executor._mark_lost)
            executor.stats.compiled_graph = executor.transport is not None
        if executor.transport is None:
            try:
                executor.transport = await SocketSteps.connect(workers, executor._mark_lost)
            except BaseException:
                executor.shutdown()
                raise
        return executor

    def kv_tiers(self) -> OffloadConfig | None:
        """The KV tiers' sizes in blocks, from the rank that holds them (tiers run at tensor-parallel size 1)."""
        tiers = self.local.runner.kv_tiers if self.local is not None else None
        return None if tiers is None else tiers.config

    @classmethod
    async def _create_local(cls, config: CBServeConfig, replica: str) -> RayExecutor:
        """One rank, run in this process on its model thread (rank.py): no worker actor, no step hop."""
        rank = Rank(config, 0, replica)
        try:
            num_blocks = await asyncio.wrap_future(rank.submit(rank.load_model))
            await asyncio.wrap_future(rank.submit(rank.init_kv_cache, num_blocks))
        except BaseException:
            rank.shutdown()
            raise
        from cbserve.cluster.engine.kv_source import attach_ray_transport  # (torch: not on the ingress's imports)

        executor = cls([], None, num_blocks, rank)
        try:
            executor.kv_source = attach_ray_transport(rank.runner.kv_tiers)
            info = rank.info()
        except BaseException:
            executor.shutdown()  # the rank, and a source already started
            raise
        executor.stats.torch_threads, executor.stats.cpu = [info["torch_threads"]], [info["cpu"]]
        executor.transport = LocalSteps(rank)
        return executor

    def _mark_lost(self, why: str) -> None:
        """A rank is gone (noticed once, by the transport): the pending step fails, the engine loop is told (it
        rebuilds now, even when idle)."""
        if self._closing or self._lost.done():
            return
        logger.error("engine worker group failed: %s", why)
        self._lost.set_result(why)
        if self.transport is not None:
            self.transport.close()
        if self.on_rank_lost is not None:
            self.on_rank_lost()

    # ---- Executor protocol ----------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send one step from the engine's event loop (the SchedulerActor's; the workers are driven from
        nowhere else); its output's future: a ``StepFailedError`` when the step raised on a live worker, a
        ``WorkerGroupError`` when a rank is gone. Cancelling the future drops the step's reply."""
        return _as_concurrent(asyncio.ensure_future(self._run_step(scheduler_output)))

    async def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.transport is not None
        start = time.perf_counter()
        step = asyncio.ensure_future(self.transport.run(scheduler_output))
        try:
            done, _ = await asyncio.wait({step, self._lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _detach(step)  # its reply still comes (in order); nobody waits for it
            raise
        if step not in done:
            _detach(step)
            raise WorkerGroupError(f"engine worker group failed: {self._lost.result()}")
        try:
            replies = step.result()
        except Exception as e:  # the hop itself failed (a rank gone)
            raise WorkerGroupError(f"engine worker group failed: {type(e).__name__}: {e}") from e
        errors = [r.error for r in replies if r.error is not None]
        if errors:
            raise WorkerGroupError(f"engine worker group failed: {errors[0]}")
        failures = [r.failure for r in replies if r.failure is not None]
        if failures:  # a step that raised on a live worker: the engine fails its culprits alone
            raise next((f for f in failures if not f.skipped), failures[0])
        return self._finish(replies[0].output, start)

    def _finish(self, out: ModelRunnerOutput | None, start: float) -> ModelRunnerOutput:
        """The hop's cost: wall time minus the worker's forward, from the later of the call and the end of
        the previous step (with async scheduling a call waits at the worker behind the one before)."""
        if out is None:
            raise WorkerGroupError("rank 0 returned no output")
        end = time.perf_counter()
        self.stats.observe(max(0.0, end - max(start, self._last_done) - out.forward_time_s))
        self._last_done = end
        return out

    # ---- an RL loop's controls (cluster/engine/rollout.py) -------------------------------------------
    async def call_ranks(self, method: str, *args: Any) -> Any:
        """A rank control (rank.py ``Rank.control``) on every rank, sent like a step: it runs after the steps sent
        before it and before any sent after. Rank 0's result; an exception a rank raised is raised here."""
        if self.transport is None or self.rank_lost:
            raise WorkerGroupError("the engine's worker group is gone")
        try:
            replies = await self.transport.run(RankCall(method, args))
        except Exception as e:
            raise WorkerGroupError(f"engine worker group failed: {type(e).__name__}: {e}") from e
        errors = [r.error for r in replies if r.error is not None]
        if errors:
            raise WorkerGroupError(f"engine worker group failed: {errors[0]}")
        raised = next((r.result for r in replies if isinstance(r.result, Exception)), None)
        if raised is not None:
            raise raised
        return replies[0].result

    async def stage_weights(self, ref: Any) -> None:
        """Every rank fetches the weights a trainer put in the object store (``ref``), while the steps go on."""
        if self.local is not None:
            self.local.stage(await ref)
        else:
            await asyncio.gather(*[w.stage_weights.remote([ref]) for w in self.workers])

    async def join_weight_group(self, info: Any) -> None:
        """Every rank joins the trainer's weight group (rl/weight_sync.py ``WeightTransferInfo``)."""
        if self.local is not None:
            await asyncio.to_thread(self.local.join_weight_group, info)
        else:
            await asyncio.gather(*[w.join_weight_group.remote(info) for w in self.workers])

    async def receive_weights(self) -> None:
        """Every rank stages the weights the trainer broadcasts on the weight group."""
        if self.local is not None:
            await asyncio.to_thread(self.local.receive_weights)
        else:
            await asyncio.gather(*[w.receive_weights.remote() for w in self.workers])

    def shutdown(self) -> None:
        self._closing = True
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for w in [*self.workers, *([self.kv_source] if self.kv_source is not None else [])]:
            ray.kill(w, no_restart=True)
        self.workers, self.kv_source = [], None
        if self.local is not None:
            self.local.shutdown()
            self.local = None
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


async def _start_workers(config: CBServeConfig, replica: str, pg_name: str) -> tuple[list[Any], Any]:
    """One WorkerActor per rank in a placement group of their own (a stale group of the name is removed first)."""
    tp = config.tensor_parallel_size
    gpu = config.resolved_device == "cuda"
    bundle: dict[str, float] = {"CPU": config.worker_num_cpus, **({"GPU": 1.0} if gpu else {})}
    _remove_stale_placement_group(pg_name)
    pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK" if tp > 1 else "PACK",
                         name=pg_name)  # fmt: skip
    try:
        await pg.ready()
    except BaseException:
        remove_placement_group(pg)
        raise
    workers = [
        WorkerActor.options(num_cpus=config.worker_num_cpus, num_gpus=1 if gpu else 0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                placement_group=pg, placement_group_bundle_index=rank),
                            ).remote(config.model_dump(), rank, replica)
        for rank in range(tp)
    ]  # fmt: skip
    return workers, pg


def _as_concurrent(task: asyncio.Future[ModelRunnerOutput]) -> Future[ModelRunnerOutput]:
    """A ``concurrent.futures.Future`` that follows ``task`` (its result, error or cancellation); cancelling it
    cancels the task."""
    future: Future[ModelRunnerOutput] = Future()

    def settle(done: asyncio.Future[ModelRunnerOutput]) -> None:
        if future.done():
            return
        if done.cancelled():
            future.cancel()
        elif done.exception() is not None:
            future.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            future.set_result(done.result())

    task.add_done_callback(settle)
    future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
    return future


def _detach(task: asyncio.Future[Any]) -> None:
    """Let ``task`` finish on its own, its result or error dropped (a step already sent cannot be taken back)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _remove_stale_placement_group(name: str) -> None:
    try:
        stale = ray.util.get_placement_group(name)
    except ValueError:  # none by that name
        return
    logger.warning("removing stale placement group %s", name)
    remove_placement_group(stale)
