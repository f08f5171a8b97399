"""A step that raises on this worker fails alone: ``StepGuard`` runs a runner's steps and turns what one raises into
``StepFailedError`` (scheduler/errors.py), the error the engine isolates (scheduler/fault_isolation.py).

- The error names the sequences to blame when the runner knew them (it raises ``StepFailedError`` itself at the
  points that act for one request: its adapter's load, its grammar's matcher; ``worker/sampling/structured.py``,
  ``model_runner.py``), else none, and the engine searches.
- After a failure the worker runs no further step of the same epoch (``SchedulerOutput.epoch``): the engine sent
  them before it knew; each comes back skipped, with only its finished and preempted ids applied. The engine
  preempts every sequence of the failed and skipped steps, so whatever the failure left half done in the
  runner's per-request state is dropped when their ids arrive with the next epoch.
- A failure of the device itself (a CUDA error: the context is lost, every later step would fail too) is not a
  request's: the process exits, and the replica is rebuilt as for any lost worker.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_DEVICE_ERRORS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "NCCL error", "illegal memory access")


class Runner(Protocol):
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def drop(self, req_ids: Any) -> None: ...


def is_device_failure(e: BaseException) -> bool:
    """Whether ``e`` says the device (its context) is broken, not the step's input."""
    text = f"{type(e).__name__}: {e}"
    return type(e).__name__ == "AcceleratorError" or any(s in text for s in _DEVICE_ERRORS)


class StepGuard:
    """``guard(so)``: the runner's output for ``so``, or ``StepFailedError``."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.failed_epoch = -1  # the epoch of the last failed step: its later steps are skipped

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.epoch <= self.failed_epoch:
            self.runner.drop(so.finished_req_ids | so.preempted_req_ids)
            raise StepFailedError(f"skipped after a failed step of epoch {so.epoch}", skipped=True)
        try:
            return self.runner.execute_model(so)
        except StepFailedError as e:
            self.failed_epoch = so.epoch
            logger.warning("step failed for %s: %s", list(e.culprits) or "unknown requests", e)
            raise
        except Exception as e:
            if is_device_failure(e):
                logger.critical("the device failed (%s: %s): this worker exits", type(e).__name__, e)
                os._exit(70)  # EX_SOFTWARE; the replica sees the worker gone and rebuilds
            self.failed_epoch = so.epoch
            logger.exception("step failed (epoch %d)", so.epoch)
            raise StepFailedError(f"{type(e).__name__}: {e}") from e
