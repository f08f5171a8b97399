"""Errors the engine raises at its edges. The HTTP layer maps them to statuses."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of errors about a request (not bugs)."""


class RequestRejectedError(EngineError):
    """The request could never run (prompt + max_tokens over the context, or over the whole KV cache).
    HTTP 400; ``param`` names the request field to blame, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # keep ``param`` across pickling (Ray hops)
        return (type(self), (str(self), self.param))


class QueueFullError(EngineError):
    """The bounded waiting queue is full. HTTP 429."""


class DuplicateRequestError(EngineError):
    """A request with this id is already in the engine. HTTP 400."""


class StepFailedError(EngineError):
    """A step raised on a worker whose process is alive (a lost process is the executor's own error: the replica
    is rebuilt). ``culprits``: the sequence ids the worker found responsible (their adapter, their grammar), empty
    when it could not tell: the engine then isolates them (``fault_isolation.py``). ``client_error``: the culprits'
    own input is at fault (HTTP 400), else 500. ``skipped``: the worker did not run the step because an earlier
    step of its epoch failed (``SchedulerOutput.epoch``)."""

    def __init__(
        self, message: str, culprits: tuple[str, ...] | list[str] = (), client_error: bool = False,
        skipped: bool = False,
    ) -> None:
        super().__init__(message)
        self.culprits = tuple(culprits)
        self.client_error = client_error
        self.skipped = skipped

    def __reduce__(self) -> tuple:  # keep the fields across pickling (the step channel, Ray)
        return (type(self), (str(self), self.culprits, self.client_error, self.skipped))
