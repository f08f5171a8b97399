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
