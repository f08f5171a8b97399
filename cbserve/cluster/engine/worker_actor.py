"""WorkerActor: one tensor-parallel rank of one engine replica, wrapping the worker's ModelRunner.

The ranks of a replica join one torch.distributed group (gloo on CPU, nccl on CUDA); rank 0 picks the
rendezvous address on a free port. Every rank receives every SchedulerOutput; only rank 0 returns its
ModelRunnerOutput in its ``StepReply`` (the others reply empty, keeping the hop small).

Everything that runs the model (loading, the KV cache, every step, whichever way it arrives: the step channel
of cluster/channel/steps.py or a compiled graph) runs on one thread of its own, the model thread. OpenMP keeps
a thread team per thread that starts parallel work, and libgomp stops spinning at barriers (a futex wake
each, ~2.5x slower steps here) once it manages more threads than there are cores: a second team would do
that. The actor's own thread stays free for pings.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import ray

from cbserve.cluster.channel.messages import StepReply
from cbserve.cluster.channel.steps import StepServer
from cbserve.cluster.channel.transport import StepAddress
from cbserve.cluster.ops.metrics import WorkerMetrics
from cbserve.cluster.ops.path_trace import PathTrace
from cbserve.cluster.stores.lora_store import StoreAdapterSource
from cbserve.config import CBServeConfig
from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.outputs import SchedulerOutput
from cbserve.worker.runner.step_guard import StepGuard

logger = logging.getLogger(__name__)
T = TypeVar("T")


@ray.remote(max_restarts=0, max_concurrency=1, concurrency_groups={"lifetime": 1})
class WorkerActor:
    def __init__(self, config: dict[str, Any], rank: int, replica: str) -> None:
        self.config = CBServeConfig.model_validate(config)
        self.rank = rank
        self.replica = replica
        self.runner: Any = None
        self.guard: StepGuard | None = None
        self.step_server: StepServer | None = None
        self.threads = self.config.worker_threads(len(os.sched_getaffinity(0)))
        if self.threads is not None:  # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1): undo that on CPU
            os.environ["OMP_NUM_THREADS"] = str(self.threads)
        self.model_thread = ThreadPoolExecutor(1, "cbserve-model", initializer=self._thread_init)
        self.metrics = WorkerMetrics(self.config.model_name, replica, rank)
        self.path = PathTrace()

    def _thread_init(self) -> None:
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)

    def _on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return self.model_thread.submit(fn, *args).result()

    # ---- set-up ---------------------------------------------------------------------------
    def node_ip_and_free_port(self) -> tuple[str, int]:
        """Rank 0 only: the address the other ranks rendezvous at."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        self._on_model_thread(self._init_distributed, master_addr, master_port)

    def _init_distributed(self, master_addr: str, master_port: int) -> None:
        world = self.config.tensor_parallel_size
        if world == 1:
            return
        import torch.distributed as dist

        device = self.config.resolved_device
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            import torch

            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=world,
        )

    def load_model(self) -> int:
        """Load this rank's shard and size the KV cache; returns the number of KV blocks it can hold."""
        return self._on_model_thread(self._load_model)

    def _load_model(self) -> int:
        from cbserve.worker.runner.executor import build_runner

        source = StoreAdapterSource(self.config.app_name) if self.config.enable_lora else None  # the kept bytes
        self.runner = build_runner(self.config.worker_model_config(rank=self.rank), progress=False, lora_source=source)
        self.guard = StepGuard(self.runner)  # a step that raises fails its requests alone (worker/runner/step_guard.py)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        return int(self.runner.determine_num_blocks())

    def init_kv_cache(self, num_blocks: int) -> None:
        self._on_model_thread(self.runner.init_kv_cache, num_blocks)

    # ---- the per-iteration call -----------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> StepReply:
        """One step (a compiled graph's call; the step channel runs ``_execute`` on the model thread itself)."""
        return self._on_model_thread(self._execute, scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> StepReply:
        """One step's reply: rank 0's output (None on the other ranks), or the ``StepFailedError`` of a step that
        raised (both hops carry it like any reply; the engine fails the requests to blame alone)."""
        self.path.sync()  # a compiled graph's step (the step channel's server syncs before reading it)
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

    def open_step_channel(self) -> StepAddress:
        """Serve the steps over a socket (cluster/channel/steps.py) from the model thread: the scheduler's
        per-step hop when it does not use a compiled graph. The model thread serves it until it closes."""
        if self.step_server is not None:
            raise RuntimeError("the step channel is already open")
        self.step_server = StepServer(self._execute, ray.util.get_node_ip_address(), self.path.sync)
        self.model_thread.submit(self.step_server.serve)
        return self.step_server.address

    def path_trace(self, command: str) -> dict[str, list[str]]:
        """Record the files the model thread runs from its next step on ("start"), or stop and return them ("stop"):
        path_trace.py."""
        return self.path.command_later(command)

    @ray.method(concurrency_group="lifetime")
    def lifetime(self) -> None:
        """Never returns: its reference fails the moment Ray knows this actor is gone (a compiled graph's liveness
        signal, compiled_graph.py; the step channel's is its socket)."""
        threading.Event().wait()

    # ---- introspection (tests, health) --------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        import torch

        loaded = self.runner is not None
        return {"rank": self.rank, "replica": self.replica, "pid": os.getpid(), "loaded": loaded,
                "node_id": ray.get_runtime_context().get_node_id(), "torch_threads": torch.get_num_threads(),
                "cpu": self.runner.cpu_report if self.runner is not None else None}

    def shutdown(self) -> None:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # best effort while tearing down
            logger.exception("destroy_process_group failed")
