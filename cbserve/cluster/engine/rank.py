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
from typing import TYPE_CHECKING, Any, TypeVar

from cbserve.cluster.channel.messages import RankCall, StepMessage, StepReply
from cbserve.cluster.ops.metrics import WorkerMetrics
from cbserve.cluster.ops.path_trace import PathTrace
from cbserve.cluster.stores.lora_store import StoreAdapterSource
from cbserve.config import CBServeConfig
from cbserve.scheduler.errors import StepFailedError
from cbserve.worker.runner.step_guard import StepGuard

if TYPE_CHECKING:  # torch is imported on the model thread only
    from cbserve.rl.weight_sync import WeightGroup, WeightTransferInfo

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
        self.staged: list[tuple[str, Any]] | None = None  # weights taken in for the next "apply_weights"
        self.weight_group: WeightGroup | None = None  # a trainer's weight group (rl/weight_sync.py)

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
    def execute(self, scheduler_output: StepMessage) -> StepReply:
        """One step's reply: rank 0's output (None on the other ranks), or the ``StepFailedError`` of a step that
        raised (every transport carries it like any reply; the engine fails the requests to blame alone). A
        ``RankCall`` runs one of the rank's controls between two steps (``control``)."""
        if isinstance(scheduler_output, RankCall):
            return self.control(scheduler_output)
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

    # ---- an RL loop's controls: between two steps, on the model thread (``RankCall``) ------------
    def control(self, call: RankCall) -> StepReply:
        """Run ``call`` on the runner: "apply_weights" (what ``stage`` took in), "sleep" (level), "wake_up" (tags).
        Its result, or the exception it raised (a refused update leaves the weights as they were), is the reply's."""
        try:
            if call.method == "apply_weights":
                staged, self.staged = self.staged, None
                if staged is None:
                    raise RuntimeError("no weights staged on this rank")
                return StepReply(result=self.runner.update_weights(staged))
            if call.method in ("sleep", "wake_up"):
                return StepReply(result=getattr(self.runner, call.method)(*call.args))
            raise ValueError(f"unknown rank control {call.method!r}")
        except Exception as e:  # noqa: BLE001 (the caller's to raise: the rank serves on)
            logger.warning("rank %d: %s failed: %s: %s", self.rank, call.method, type(e).__name__, e)
            return StepReply(result=e)

    def stage(self, weights: Any) -> int:
        """Take in new weights, HF-named (a mapping or (name, tensor) pairs), for the next "apply_weights" (off the
        model thread: the steps go on meanwhile). Returns how many tensors."""
        self.staged = list(weights.items() if isinstance(weights, dict) else weights)
        return len(self.staged)

    def join_weight_group(self, info: WeightTransferInfo) -> None:
        """Join a trainer's weight group (rl/weight_sync.py) as rank ``info.rank_offset`` + this rank (blocks until
        every member joined)."""
        if self.weight_group is not None:
            self.weight_group.close()
        self.weight_group = info.open(self.rank)

    def receive_weights(self) -> int:
        """Stage the weights the trainer broadcasts on the weight group now."""
        if self.weight_group is None:
            raise RuntimeError("init_weight_transfer first: this rank is in no weight group")
        return self.stage(self.weight_group.receive())

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
        self.runner = self.guard = self.staged = None
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None
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

    async def run(self, so: StepMessage) -> list[StepReply]:
        return [await asyncio.wrap_future(self.rank.submit(self.rank.execute, so))]

    def close(self) -> None:
        pass
