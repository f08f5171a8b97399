"""One request's state inside the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cbserve.scheduler.requests.kv_transfer import KVTransferParams
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.retention import Retention
from cbserve.scheduler.requests.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASON

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class EngineRequest:
    """What a client hands to EngineCore.add_request()."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the "priority" ordering
    cache_salt: str | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    client: int = 0  # which of the host's clients sent it (an engine replica: the ingress channel); its outputs say
    retention: tuple[Retention, ...] = ()  # ranges of its prompt to keep cached (kv/retention.py)
    kv_transfer: KVTransferParams | None = None  # its part in prefill/decode disaggregation (kv_transfer.py)
    # its first prefix-cache block's extra keys, from cache_salt and lora when built (change those by building anew)
    extra_keys: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.extra_keys = cache_extra_keys(self.cache_salt, self.lora)


@dataclass(frozen=True)
class RequestFailure:
    """Why a request ended with finish reason "error": its own execution failed (``client_error``: its input was at
    fault, HTTP 400; else 500). Other requests are not affected."""

    message: str
    client_error: bool = False


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one sequence since the last step (what is streamed to the client).

    For n > 1 / best_of / beam search, each sequence is reported under ``req_id`` = the client's id and
    its ``index`` (0..num_sequences-1). With best_of or beam search, outputs are only final at finish.
    """

    req_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list | None  # list[TokenLogprob] when asked for
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cumulative_logprob: float | None = None
    # For best_of / beam search only: the final token ids of this sequence (replaces the stream).
    final_token_ids: list[int] | None = None
    # With ``prompt_logprobs``: on the request's first output, one entry per prompt token (the first None).
    prompt_logprobs: list | None = None
    # Pooling engines: the request's embedding, on its one (finished) output.
    embedding: list[float] | None = None
    # Finish reason "error": what failed (the request alone: see fault_isolation.py).
    error: RequestFailure | None = None
    client: int = 0  # the request's ``EngineRequest.client``: where the host sends this output
    weights_version: int = 0  # the version of the weights that ran its step (EngineCore.set_weights_version)
    # A producer's answer to ``do_remote_decode`` on the request's last output (requests/kv_transfer.py)
    kv_transfer_params: dict | None = None


def cache_extra_keys(cache_salt: str | None, lora: LoRARequest | None) -> tuple:
    """The extra keys of a request's first prefix-cache block: its cache salt, then its adapter's key."""
    return ((cache_salt,) if cache_salt is not None else ()) + (() if lora is None else lora.cache_keys)
