"""Fault injection for the tests of failure domains: a test model makes the worker fail for one chosen request.

A model folder whose ``config.json`` has ``"cbserve_fault_injection": {"point": ..., "token_id": T}`` (only test
models do: tests/e2e/fault_lib.py writes one) makes its worker fail whenever token ``T`` is among a step's tokens,
at one of these points:

- ``"forward"``: the model's step raises (``InjectedFault``), naming no request: the engine must find the culprit
  (scheduler/fault_isolation.py). With ``T`` in the prompt the step that prefills it raises; a request that makes
  the model generate ``T`` (``logit_bias``) raises at its next decode step, mid-stream.
- ``"mask"``: the structured-output matcher of a constrained sequence holding ``T`` raises, as a broken grammar or
  logits processor would (worker/sampling/structured.py names the sequence).
- ``"exit"``: the worker process exits at once, as one killed by the OS would (the replica is lost and rebuilt;
  the ingress retries what it may elsewhere and fails a request present at two replica losses).

Nothing else reads the key: a real model never has it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

FAULT_KEY = "cbserve_fault_injection"
POINTS = ("forward", "mask", "exit")


class InjectedFault(RuntimeError):
    """The failure a test model asked for."""


@dataclass(frozen=True)
class FaultPlan:
    point: str
    token_id: int

    @classmethod
    def of(cls, hf_config: Any) -> FaultPlan | None:
        """The test model's plan (None for every real model). A malformed one is refused."""
        spec = getattr(hf_config, FAULT_KEY, None)
        if spec is None:
            return None
        if not isinstance(spec, dict) or spec.get("point") not in POINTS or not isinstance(spec.get("token_id"), int):
            raise ValueError(f"{FAULT_KEY} must be {{'point': one of {POINTS}, 'token_id': int}}, got {spec!r}")
        logger.warning("fault injection (a test model): %s when token %d runs", spec["point"], spec["token_id"])
        return cls(spec["point"], spec["token_id"])

    def check_step(self, input_ids: torch.Tensor) -> None:
        """The ``forward`` and ``exit`` points, on a step's flattened input tokens."""
        if self.point == "mask" or not bool((input_ids == self.token_id).any()):
            return
        if self.point == "exit":
            logger.critical("fault injection: token %d ran, the worker process exits", self.token_id)
            os._exit(1)
        raise InjectedFault(f"injected fault: token {self.token_id} in the step")

    def check_sequence(self, token_ids: Sequence[int]) -> None:
        """The ``mask`` point, on one constrained sequence's tokens."""
        if self.point == "mask" and self.token_id in token_ids:
            raise InjectedFault(f"injected fault in a structured-output mask: token {self.token_id}")
