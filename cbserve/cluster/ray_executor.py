"""RayExecutor: the scheduler's Executor over one replica's WorkerActors (one per tensor-parallel rank).

Every rank gets each SchedulerOutput; rank 0's ModelRunnerOutput is used. The per-iteration hop goes through
a Ray compiled graph (``ray.dag``: pre-allocated shared-memory channels, no task submission per call) when
``use_compiled_graph`` (CUDA by default), else through one socket per rank (cluster/step_channel.py: no Ray
task per step, no busy wait; a compiled graph that fails to build falls back to it). ``dispatch overhead`` =
wall time of one execute minus the worker-reported forward time: what the hop costs per iteration.

Two kinds of failure, kept apart. A step that raised on a live worker comes back as its ``StepFailedError``
(a reply like any other): the engine fails the requests to blame and goes on (scheduler/fault_isolation.py).
A rank that is gone (its process or node) breaks the group: the pending step and every later one fail with
``WorkerGroupError`` and the replica rebuilds. A gone rank is noticed once, by one signal per hop: the step
channel's socket (end of file at once when the process dies; TCP keepalive within ``transport.KEEPALIVE_S``
when its node vanishes), or, with a compiled graph, Ray's actor death (a pending ``lifetime`` call per rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cbserve.cluster.step_channel import StepClient, dumps
from cbserve.cluster.worker_actor import WorkerActor
from cbserve.config import CBServeConfig
from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerGroupError(RuntimeError):
    """A worker actor died or the workers' channel broke: the replica must be rebuilt."""


@dataclass
class DispatchStats:
    compiled_graph: bool = False
    num_calls: int = 0
    total_overhead_s: float = 0.0
    last_overhead_s: float = 0.0
    torch_threads: list[int] = field(default_factory=list)  # per rank, as the workers report them
    pids: list[int] = field(default_factory=list)  # per rank: the worker processes (cluster/cpu_priority.py)
    cpu: list[dict[str, Any] | None] = field(default_factory=list)  # per rank: CPU ops, ISA level, probe

    def observe(self, overhead_s: float) -> None:
        self.num_calls += 1
        self.total_overhead_s += overhead_s
        self.last_overhead_s = overhead_s

    @property
    def mean_overhead_s(self) -> float:
        return self.total_overhead_s / self.num_calls if self.num_calls else 0.0


class RayExecutor:
    """Built with ``await RayExecutor.create(config, replica)`` (loads the model on every rank)."""

    def __init__(self, workers: list[Any], pg: Any, num_blocks: int) -> None:
        self.workers = workers
        self.pg = pg
        self.num_blocks = num_blocks
        self.stats = DispatchStats()
        self._cgraph: Any = None
        self._channels: list[StepClient] = []
        self._watchers: list[asyncio.Future[None]] = []  # compiled graph: one lifetime call per rank
        self._lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # why the group broke
        self._closing = False
        self.on_rank_lost: Callable[[], None] | None = None  # called once when a rank is gone (the engine loop)
        self._last_done = 0.0  # perf_counter() when the last step's output came back

    @property
    def rank_lost(self) -> bool:
        """A rank is gone: the group is broken, even while it is idle."""
        return self._lost.done()

    @classmethod
    async def create(cls, config: CBServeConfig, replica: str, pg_name: str) -> RayExecutor:
        """``pg_name`` is unique per replica: a group left behind by a crashed predecessor is removed."""
        tp = config.tensor_parallel_size
        gpu = config.resolved_device == "cuda"
        bundle: dict[str, float] = {"CPU": config.worker_num_cpus}
        if gpu:
            bundle["GPU"] = 1.0
        _remove_stale_placement_group(pg_name)
        pg = placement_group(
            [dict(bundle) for _ in range(tp)], strategy="STRICT_PACK" if tp > 1 else "PACK", name=pg_name
        )
        try:
            await pg.ready()
            workers = [
                WorkerActor.options(
                    num_cpus=config.worker_num_cpus,
                    num_gpus=1 if gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank
                    ),
                ).remote(config.model_dump(), rank, replica)
                for rank in range(tp)
            ]
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
            executor.compile()
        if executor._cgraph is None:
            try:
                await executor.open_channels()
            except BaseException:
                executor.shutdown()
                raise
        else:
            executor.watch_ranks()
        return executor

    async def open_channels(self) -> None:
        """Connect to every rank's step channel (cluster/step_channel.py): the one hop of every step, and the one
        signal that a rank is gone (its socket closes)."""
        addresses = await asyncio.gather(*[w.open_step_channel.remote() for w in self.workers])
        self._channels = [
            await StepClient.connect(a, lambda why, rank=rank: self._mark_lost(f"worker rank {rank}: {why}"))
            for rank, a in enumerate(addresses)
        ]

    def watch_ranks(self) -> None:
        """With a compiled graph (no socket of ours): one pending ``lifetime`` call per rank, which fails when Ray
        knows the rank is gone (its process or node)."""
        self._watchers = [asyncio.ensure_future(self._when_gone(rank, w.lifetime.remote()))
                          for rank, w in enumerate(self.workers)]

    async def _when_gone(self, rank: int, lifetime: Any) -> None:
        with contextlib.suppress(Exception):  # the rank died (or was killed at shutdown)
            await lifetime
        self._mark_lost(f"worker rank {rank} is gone")

    def _mark_lost(self, why: str) -> None:
        """A rank is gone (noticed once): the pending step fails, the engine loop is told (it rebuilds now, even
        when idle)."""
        if self._closing or self._lost.done():
            return
        logger.error("engine worker group failed: %s", why)
        self._lost.set_result(why)
        for channel in self._channels:
            channel.close()
        if self.on_rank_lost is not None:
            self.on_rank_lost()

    def compile(self) -> None:
        """Build the compiled graph (scheduler -> all ranks); the step channel is used if it fails."""
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([w.execute_model.bind(inp) for w in self.workers])
            self._cgraph = dag.experimental_compile(enable_asyncio=True)
            self.stats.compiled_graph = True
        except Exception:
            logger.exception("Ray compiled graph unavailable; using the step channel")
            self._cgraph = None

    # ---- Executor protocol ----------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send one step from the engine's event loop (the SchedulerActor's; the workers are driven from
        nowhere else); its output's future. The ranks are watched while it runs: a lost rank fails it with
        ``WorkerGroupError``, and cancelling the future cancels the step."""
        return _as_concurrent(asyncio.ensure_future(self._run_step(scheduler_output)))

    async def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        step = asyncio.ensure_future(self._execute(scheduler_output))
        try:
            done, _ = await asyncio.wait({step, self._lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _detach(step)  # its reply still comes (in order); nobody waits for it
            raise
        if step not in done:
            _detach(step)
            raise WorkerGroupError(f"engine worker group failed: {self._lost.result()}")
        try:
            outputs = step.result()
        except Exception as e:  # the hop itself failed (a rank gone, or a step the guard did not catch)
            raise WorkerGroupError(f"engine worker group failed: {type(e).__name__}: {e}") from e
        failures = [o for o in outputs if isinstance(o, StepFailedError)]
        if failures:  # a step that raised on a live worker: the engine fails its culprits alone
            raise next((f for f in failures if not f.skipped), failures[0])
        return self._finish(outputs[0], start)

    async def _execute(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput | StepFailedError | None]:
        if self._cgraph is not None:
            futures = await self._cgraph.execute_async(scheduler_output)
            return [await f for f in futures]
        data = dumps(scheduler_output)
        return list(await asyncio.gather(*[c.call(data) for c in self._channels]))

    def _finish(self, out: ModelRunnerOutput | None, start: float) -> ModelRunnerOutput:
        """The hop's cost: wall time minus the worker's forward, from the later of the call and the end of
        the previous step (with async scheduling a call waits at the worker behind the one before)."""
        if out is None:
            raise WorkerGroupError("rank 0 returned no output")
        end = time.perf_counter()
        self.stats.observe(max(0.0, end - max(start, self._last_done) - out.forward_time_s))
        self._last_done = end
        return out

    def shutdown(self) -> None:
        self._closing = True
        for watcher in self._watchers:
            watcher.cancel()
        for channel in self._channels:
            channel.close()
        self._channels = []
        if self._cgraph is not None:
            try:
                self._cgraph.teardown()
            except Exception:
                logger.debug("compiled graph teardown failed", exc_info=True)
            self._cgraph = None
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


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
