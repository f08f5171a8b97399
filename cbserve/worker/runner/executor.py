"""LocalExecutor: the scheduler's Executor protocol over an in-process ModelRunner (one rank, no Ray)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from cbserve.worker.config import ModelConfig
from cbserve.worker.lora.files import AdapterSource
from cbserve.worker.runner.model_runner import ModelRunner
from cbserve.worker.runner.sim_runner import SimRunner
from cbserve.worker.runner.step_guard import StepGuard
from cbserve.worker.sim_cost import SIM_MODEL

logger = logging.getLogger(__name__)


def build_runner(
    model_config: ModelConfig,
    progress: bool = True,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    lora_source: AdapterSource | None = None,
) -> ModelRunner | SimRunner:
    """The worker's runner: ``ModelRunner``, or ``SimRunner`` for ``model: sim`` (the simulated engine).
    ``lora_source``: where its LoRA manager gets the adapters' checked bytes, by digest (worker/lora/manager.py)."""
    cls = SimRunner if model_config.model == SIM_MODEL else ModelRunner
    runner = cls(model_config, progress, weights)
    if lora_source is not None and getattr(runner, "lora", None) is not None:
        runner.lora.source = lora_source  # type: ignore[union-attr]
    return runner


class LocalExecutor:
    """Loads the model, sizes and allocates the KV cache, then runs each iteration in this process.

    ``num_blocks=None`` sizes the cache from memory (``ModelConfig.kv_cache_memory_bytes`` on CPU,
    ``gpu_memory_utilization`` on CUDA); read the result from ``executor.num_blocks`` to build the
    engine's CacheConfig. ``weights``: HF-named tensors to load instead of the model folder's (benchmarks).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int | None = None,
        progress: bool = True,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        if model_config.tensor_parallel_size != 1:
            raise ValueError("LocalExecutor runs one rank; use the Ray executor for tensor_parallel_size > 1")
        self.runner = build_runner(model_config, progress, weights)
        self.guard = StepGuard(self.runner)  # a step that raises: StepFailedError (step_guard.py)
        self.num_blocks = num_blocks if num_blocks is not None else self.runner.determine_num_blocks()
        self.runner.init_kv_cache(self.num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            model_config.block_size,
            self.num_blocks * self.runner.block_bytes() / 2**20,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Runs the step in place: the future comes back done (or holding the step's error)."""
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.guard(scheduler_output))
        except Exception as e:
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        self.runner.shutdown()
