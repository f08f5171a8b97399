"""A step that raises fails its culprit alone: the engine's side of a ``StepFailedError``.

A worker whose process is alive answers a step that raised with ``StepFailedError`` (errors.py), naming the
sequences it could blame (a request's adapter that cannot be loaded, its grammar's matcher) or none. The
engine then (``EngineCore.complete_oldest_step`` -> ``recover``):

1. drops the failed step and every step sent after it (the worker skips them: ``SchedulerOutput.epoch``), and
   sends their finished and preempted ids again;
2. preempts every sequence of the requests those steps held: they are recomputed from their tokens, as after
   any preemption (prefix-cache hits make that cheap), so whatever the failed step left half done at the worker
   (block tables, samples, grammar matchers) is dropped with them;
3. fails the culprits the worker named (finish reason "error", ``RequestFailure``) or, when it named none,
   searches for them (``FaultIsolation``) while every other request runs on.

The search is delta debugging over the requests of the failed step. A step that held one request convicts it.
Otherwise the requests are suspects and only a part of them, the probe, may run; the others wait (``held``:
never admitted meanwhile), and everything that was not in the failed step runs as usual. A probe whose every
request produced an output is cleared; a step that fails again narrows the suspects to the probe's requests in
it, plus the requests it was the first to run ("fresh": admitted, resumed or still prefilling; a poison that
arrived meanwhile), and the probe is halved; a single suspect left in a failed step is the culprit. The first
probe is the split the failed step itself suggests: the requests it did not admit or change run, the fresh ones
wait. A fault that does not come back (a probe of the last suspect passes) clears everyone. At most
``2 * bit_length(n) + 2`` failures are spent on one search of n requests; past that its suspects fail together,
so a search always ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from cbserve.scheduler.outputs import SchedulerOutput
from cbserve.scheduler.requests.request import RequestOutput

logger = logging.getLogger(__name__)


def not_held(held: frozenset[str], select: Callable[[object], bool] | None) -> Callable[[object], bool]:
    """``select`` (None: any) without the requests (ids) held back while a failed step's culprit is searched."""
    if select is None:
        return lambda seq: seq.group.req_id not in held  # type: ignore[attr-defined]
    return lambda seq: seq.group.req_id not in held and select(seq)  # type: ignore[attr-defined]


def _ordered(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def step_requests(so: SchedulerOutput, group_of: Callable[[str], str]) -> tuple[list[str], list[str]]:
    """The request ids of a step's sequences, in order, and those the step was the first to run ("fresh": sent
    as new, or given a prefill chunk rather than one decode token)."""
    spec = so.scheduled_spec_decode_tokens
    fresh = [group_of(r.req_id) for r in so.scheduled_new_reqs]
    fresh += [group_of(c.req_id) for c in so.scheduled_cached_reqs
              if so.num_scheduled_tokens.get(c.req_id, 0) > 1 and c.req_id not in spec]
    return _ordered(group_of(s) for s in so.num_scheduled_tokens), _ordered(fresh)


@dataclass
class FaultIsolation:
    """The search for the culprit of a step that failed without naming one (see the module docstring)."""

    suspects: list[str] = field(default_factory=list)  # request ids, in the order the failed step held them
    probe: list[str] = field(default_factory=list)  # the suspects that may run now
    passed: set[str] = field(default_factory=set)  # probe requests that produced an output since the probe began
    seen: set[str] = field(default_factory=set)  # every request of the search's failed steps (recomputed since)
    failures: int = 0  # failed steps in this search
    budget: int = 0  # the most failed steps this search may take

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    @property
    def held(self) -> frozenset[str]:
        """The suspects that wait (never admitted while the probe runs)."""
        return frozenset(self.suspects) - frozenset(self.probe)

    def on_failure(self, failed: list[str], fresh: list[str]) -> list[str]:
        """A step holding the requests ``failed`` (``fresh``: those it was the first to run) raised without naming
        a culprit. Returns the requests to fail now (the culprit, once found)."""
        if self.active:
            # a request the search already recomputed is not fresh: only one that arrived meanwhile is
            narrowed = [r for r in failed if r in self.suspects or (r in fresh and r not in self.seen)]
            self.seen.update(failed)
            if narrowed:
                self.failures += 1
                return self._narrow(narrowed)
        self.suspects, self.failures, self.budget = list(failed), 1, 2 * len(failed).bit_length() + 2
        self.seen = set(failed)
        if len(failed) > 1 and 0 < len(fresh) < len(failed):
            self._probe([r for r in failed if r not in fresh])  # fresh ones wait: the step's own split
            return []
        return self._narrow(list(failed))

    def _narrow(self, suspects: list[str]) -> list[str]:
        if len(suspects) == 1 or self.failures > self.budget:
            if len(suspects) > 1:
                logger.error("step failures: no single culprit found in %d failed steps; failing %s",
                             self.failures, suspects)
            self.reset()
            return suspects
        self.suspects = suspects
        self._probe(suspects[: (len(suspects) + 1) // 2])
        return []

    def on_outputs(self, outputs: list[RequestOutput], alive: Collection[str]) -> None:
        """A step went through: a probe request with an output ran past its fault (or has none); suspects no longer
        ``alive`` (finished, aborted) leave the search."""
        if not self.active:
            return
        self.suspects = [r for r in self.suspects if r in alive]
        self.probe = [r for r in self.probe if r in alive]
        self.passed.update(o.req_id for o in outputs)
        if any(r not in self.passed for r in self.probe):
            return
        probe = set(self.probe)
        self.suspects = [r for r in self.suspects if r not in probe]
        if not self.suspects:
            logger.info("step failures: every suspect ran again without the fault; nobody failed")
            self.reset()
            return
        self._probe(self.suspects[: (len(self.suspects) + 1) // 2])

    def _probe(self, probe: list[str]) -> None:
        self.probe, self.passed = probe, set()

    def reset(self) -> None:
        self.suspects, self.failures, self.budget, self.seen = [], 0, 0, set()
        self._probe([])
