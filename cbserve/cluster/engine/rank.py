"""One tensor-parallel rank of an engine replica: its model thread, its ModelRunner behind the step guard, its
metrics and its path trace. A replica of tensor-parallel size 1 runs its one rank in the SchedulerActor's own
process (``LocalSteps``: a step is a call on the model thread, nothing pickled, no socket, no process to watch:
vLLM's ``UniProcExecutor``); a larger replica runs one ``Rank`` in each WorkerActor (worker_actor.py).

Everything that runs the model (loading, the KV cache, every step) runs on one thread of its own, the model thread.
OpenMP keeps a thread team per thread that starts parallel work, and libgomp stops spinning at barriers (a futex
wake each, ~2.5x slower steps here) once it manages more threads than there are cores: a second team would do
that. The caller's thread stays free (a WorkerActor's for pings, the SchedulerActor's for its event loop).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from cbserve.cluster.channel.messages import StepReply
from cbserve.cluster.ops.metrics import WorkerMetrics
from cbserve.cluster.ops.path_trace import PathTrace
from cbserve.cluster.stores.lora_store import StoreAdapterSource
from cbserve.config import CBServeConfig
from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.outputs import SchedulerOutput
from cbserve.worker.runner.step_guard import StepGuard

logger = logging.getLogger(__name__)
T = TypeVar("T")
RELEASE_TIMEOUT_S = 60.0


class Rank:
    def __init__(self, config: CBServeConfig, rank: int, replica: str) -> None:
        self.config = config
        self.rank = rank
        self.replica = replica
        self.runner: Any = None
        self.guard: StepGuard | None = None
        self.threads = config.worker_threads(len(os.sched_getaffinity(0)))
        if self.threads is not None:  # Ray sets OMP_NUM_THREADS to the actor's num_cpus: undo that on CPU
            os.environ["OMP_NUM_THREADS"] = str(self.threads)
        self.model_thread = ThreadPoolExecutor(1, "cbserve-model", initializer=self._thread_init)
        self.metrics = WorkerMetrics(config.model_name, replica, rank)
        self.path = PathTrace()  # the model thread's: started and stopped at its next step (``sync``)

    def _thread_init(self) -> None:
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` on the model thread."""
        return self.model_thread.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the model thread and wait for it (a WorkerActor's set-up calls)."""
        return self.submit(fn, *args).result()

    # ---- set-up (on the model thread) --------------------------------------------------------
    def init_distributed(self, master_addr: str, master_port: int) -> None:
        world = self.config.tensor_parallel_size
        if world == 1:
            return
        import torch.distributed as dist

        device = self.config.resolved_device
        if device == "cuda":
            import torch

            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo",
                                init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank, world_size=world)

    def load_model(self) -> int:
        """Load this rank's shard and size the KV cache; returns the number of KV blocks it can hold."""
        from cbserve.worker.runner.executor import build_runner

        source = StoreAdapterSource(self.config.app_name) if self.config.enable_lora else None  # the kept bytes
        self.runner = build_runner(self.config.worker_model_config(rank=self.rank), progress=False, lora_source=source)
        self.guard = StepGuard(self.runner)  # a step that raises fails its requests alone (worker/runner/step_guard.py)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        return int(self.runner.determine_num_blocks())

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    # ---- the per-iteration call (on the model thread) ------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> StepReply:
        """One step's reply: rank 0's output (None on the other ranks), or the ``StepFailedError`` of a step that
        raised (every transport carries it like any reply; the engine fails the requests to blame alone)."""
        self.path.sync()
        start = time.perf_counter()
        try:
            out = self.guard(scheduler_output)  # type: ignore[misc]
        except StepFailedError as e:
            return StepReply(failure=e)
        elapsed = time.perf_counter() - start
        lora = getattr(self.runner, "lora", None)  # adapter loads and evictions (enable_lora)
        self.metrics.observe_forward(elapsed, *((lora.num_loads, lora.num_evictions) if lora is not None else ()))
        if self.rank != 0:
            return StepReply()
        out.forward_time_s = out.forward_time_s or elapsed
        return StepReply(out)

    # ---- introspection and the end ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """What the executor reports per rank (its ``DispatchStats``): threads, process, CPU report."""
        import torch

        return {"rank": self.rank, "replica": self.replica, "pid": os.getpid(), "loaded": self.runner is not None,
                "torch_threads": self.threads if self.threads is not None else torch.get_num_threads(),
                "cpu": self.runner.cpu_report if self.runner is not None else None}  # fmt: skip

    def shutdown(self) -> None:
        """Release the model, its KV cache and tiers (on the model thread, after the steps queued there), so that a
        replica rebuilt in this process finds the memory free."""
        try:
            self.submit(self._release).result(timeout=RELEASE_TIMEOUT_S)
        except Exception:  # best effort while tearing down (a step stuck in the model)
            logger.exception("releasing the rank's model failed")
        self.runner = self.guard = None
        self.model_thread.shutdown(wait=False)
        gc.collect()  # what the engine's frozen generation (tune_gc_for_serving) kept of it goes too

    def _release(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class LocalSteps:
    """The step transport of a replica of one rank, run in the engine's own process: a step is a call on the rank's
    model thread (the steps run in the order they were sent; two may be queued with async scheduling). No liveness
    signal: the rank lives and dies with the engine actor, which the ingress watches (its channel's socket)."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank

    async def run(self, so: SchedulerOutput) -> list[StepReply]:
        return [await asyncio.wrap_future(self.rank.submit(self.rank.execute, so))]

    def close(self) -> None:
        pass
