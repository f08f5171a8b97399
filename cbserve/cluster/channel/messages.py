"""The typed messages of cbserve's own sockets, every frame after the token one of these, pickled (transport.py):
what an ingress replica and an engine replica say to each other on their channel (output_channel.py,
channel_reader.py), and a worker rank's reply to a step (step_channel.py).

Ingress -> engine: ``OpenChannel`` first (which channel this connection is), then any number of ``AddRequest``,
``AbortRequest`` and ``FinishSequence``. Engine -> ingress: ``OutputFrame``s, each carrying, per request, its
items since the previous frame in order: ``Admitted`` (the answer to its AddRequest) or an ``EngineFailure`` (the
refusal, or why it stopped abnormally), then its ``RequestOutput``s; the engine's prefix-cache events; and its
``EngineState`` when it changed (the first frame of a channel always has it): the ingress learns whether the
replica serves from its channel, not by asking.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.kv.kv_events import KVCacheEvents
from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput


# ---- ingress -> engine ------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenChannel:
    """A connection's first frame (after the token): the channel it is, and so whose outputs it reads."""

    channel_id: str


@dataclass(frozen=True)
class AddRequest:
    """Admit ``request``; its outputs go to this channel. Answered on the channel: ``Admitted`` or an
    ``EngineFailure`` for the request, before any of its outputs."""

    request: EngineRequest


@dataclass(frozen=True)
class AbortRequest:
    """End the request and free its KV blocks (idempotent)."""

    req_id: str


@dataclass(frozen=True)
class FinishSequence:
    """The ingress saw a stop string in sequence ``index`` of the request: finish it (reason "stop")."""

    req_id: str
    index: int = 0


IngressMessage = AddRequest | AbortRequest | FinishSequence


# ---- engine -> ingress ------------------------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    """The engine took the request in (its first item; none of its outputs come before it)."""


ADMITTED = Admitted()


@dataclass(frozen=True)
class EngineFailure:
    """Sent instead of outputs when a request cannot run or stops abnormally.
    kind: "rejected" (400), "queue_full" (429), "duplicate" (400), "unavailable" (503), "aborted" (503),
    "timeout" (504: request_timeout_s passed; the ingress side sets it), "internal" (500), "failed" (500: its own
    step failed, scheduler/fault_isolation.py; "rejected" when its input was at fault). Only "queue_full" and
    "unavailable" are retried on another replica."""

    kind: str
    message: str


Item = RequestOutput | EngineFailure | Admitted
Items = list[Item]
Batch = dict[str, Items]  # req_id -> its items since the previous frame, in order


@dataclass(frozen=True)
class EngineState:
    """The engine replica's state: "starting", "ready", "restarting" (its workers are rebuilt after a loss),
    "failed" (its configuration or model cannot serve: ``error`` says why) or "stopped"; ``generation`` counts
    the builds of its model (worker group or in-actor rank) by this actor, ``actor`` names the actor's life (a new
    one each time Ray restarts it: the ingress counts the builds on across restarts)."""

    state: str
    generation: int = 0
    error: str | None = None
    actor: str = ""


@dataclass(frozen=True)
class OutputFrame:
    """One engine -> ingress message: the outputs, the prefix-cache changes since the last frame (None: none) and
    the replica's state when it changed (None: unchanged)."""

    batch: Batch
    cache_events: KVCacheEvents | None = None
    state: EngineState | None = None


# ---- engine -> worker rank -> engine (the step channel, cluster/channel/steps.py, or a compiled graph) ---------
@dataclass(frozen=True)
class RankCall:
    """Sent to every rank in place of a step, in order with the steps (none runs beside it): ``method`` of the rank's
    controls (cluster/engine/rank.py ``Rank.CONTROLS``: apply staged weights, sleep, wake up) with ``args``;
    answered with a ``StepReply`` whose ``result`` is its return value, or the exception it raised."""

    method: str
    args: tuple = ()


StepMessage = SchedulerOutput | RankCall  # what a rank is sent, in order: a step, or a control call


@dataclass(frozen=True)
class StepReply:
    """A worker rank's answer to one ``SchedulerOutput`` (the step itself is that dataclass, scheduler/outputs.py):
    rank 0's ``ModelRunnerOutput`` (None on the other ranks), or the ``StepFailedError`` of a step that raised on a
    live worker (worker/runner/step_guard.py: the engine fails its culprits alone), or ``error``: the worker's end
    of the hop itself failed (a bug; the replica rebuilds its workers); to a ``RankCall``: its ``result``."""

    output: ModelRunnerOutput | None = None
    failure: StepFailedError | None = None
    error: str | None = None
    result: object = None
