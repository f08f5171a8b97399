"""The messages between the scheduler and the workers: one SchedulerOutput and one ModelRunnerOutput per
iteration. Plain dataclasses of ints and strings: cheap to pickle across a Ray hop.

Protocol (the scheduler is the single source of truth for token ids):
- A request the worker has not seen (new, resumed after preemption, or a fork child) comes once as
  ``NewRequestData`` with all its token ids, its whole block table and ``num_computed_tokens`` (tokens
  whose KV is already in the cache, e.g. prefix-cache hits).
- A request the worker already holds comes as ``CachedRequestData``: the token ids appended since the
  worker last saw it that it does not already have, the block ids appended to its table, and its
  ``num_computed_tokens`` before this iteration. The worker appends the one token it samples for a
  sequence itself (not at an n > 1 fork point, where it samples several, nor under beam search, where
  the scheduler picks the tokens): the scheduler never sends such a token back. That is what lets
  async scheduling (``SchedulerConfig.async_scheduling``) schedule a sequence's next token before the
  sample it takes as input is back: the worker runs the steps in order and fills it in.
- ``num_scheduled_tokens[req_id]`` tokens are computed this iteration, starting at
  ``num_computed_tokens``; a request is sampled only when this reaches the end of its known tokens.
- Speculative decoding: ``scheduled_spec_decode_tokens[req_id]`` holds the k draft tokens proposed for a
  request the worker holds; its ``num_scheduled_tokens`` is then 1 + k (its last token and the drafts).
  The worker verifies them in the same forward pass and returns the accepted drafts plus one token (the
  target's own at the first mismatch, or a bonus token), keeps those like a sample and rolls its
  ``num_computed_tokens`` back to ``len(token_ids) - 1`` and its block table to the blocks those tokens
  need; the scheduler does the same (``spec_decode.rollback``).
- ``block_copies`` (src, dst) are carried out before the forward pass (copy-on-write after a fork).
- ``finished_req_ids`` and ``preempted_req_ids``: the worker drops its state for them (an id it does not hold
  is no error: after a failed step the engine sends the ids of the steps it dropped again).
- A step that raises on a worker whose process is alive comes back as ``StepFailedError`` (errors.py), naming the
  sequences it could blame. The worker then runs no further step of the same ``epoch`` (those already sent
  come back as skipped; only their finished and preempted ids are applied), and the engine preempts every
  sequence of the failed and dropped steps (they are recomputed, as after any preemption) and sends its next
  steps with the next epoch: whatever a failed step left half done at the worker is dropped with them.
- Pooling (an engine with ``EngineConfig.runner == "pooling"``): the worker samples nothing; at the step that
  completes a request's prompt it returns the request's pooled vector in ``ModelRunnerOutput.pooled`` (pooling
  over prompt chunks accumulates in its own state) and the engine finishes the request with it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from cbserve.scheduler.kv.connector import KVTransfer, KVTransferResult
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.scheduler.requests.sequence import Sequence


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + any generated tokens (resumed or forked requests)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Number of tokens to sample at the position that completes this request's prefill (n>1 fork
    # happens once the prompt is computed: the worker samples ``num_samples`` tokens from one row).
    num_samples: int = 1
    # Seed for this sequence (already offset per fork child), None for unseeded sampling.
    seed: int | None = None
    lora: LoRARequest | None = None  # the adapter its tokens run with (None: the base model)


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class StepState:
    """What one schedule() call decided (the scheduler's own record beside the ``SchedulerOutput`` it sends), plus its
    counters for the stats."""

    budget: int
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec: dict[str, list[int]] = field(default_factory=dict)  # draft tokens by seq id
    num_draft_tokens: int = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.scheduled.append((seq, num_tokens))
        self.budget -= num_tokens
        if num_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += num_tokens


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    epoch: int = 0  # bumped by the engine after a failed step (see the module docstring)
    kv_transfer: KVTransfer | None = None  # moves between the pool and the KV tiers (scheduler/kv/offload.py)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def is_idle(self) -> bool:
        """Nothing for the worker to do: no token to compute and no KV to move (such a step is not sent)."""
        return self.total_num_scheduled_tokens == 0 and not self.kv_transfer


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one sampled token plus the top alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """What the worker returns for one SchedulerOutput: only requests that were sampled appear."""

    req_ids: list[str] = field(default_factory=list)
    # One list per req id: one token normally, ``num_samples`` when a prefill completes with n>1.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Parallel to sampled_token_ids when the request asked for logprobs, else None per request.
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    forward_time_s: float = 0.0  # worker-side wall time of the forward pass + sampling
    # Requests asking for prompt logprobs: req id -> (prompt position of the first entry, one entry per
    # prompt token scored this step: the logits at position p - 1 scoring prompt token p).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Speculative decoding with a draft model: req id -> the draft's proposal for its next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling engines: req id -> the request's embedding, for requests whose prompt completed this step.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    kv_transfer: KVTransferResult | None = None  # the KV tiers' report (with tiers on)


class Executor(Protocol):
    """Runs iterations on the workers. worker/ (LocalExecutor) and cluster/ (RayExecutor) implement it.

    ``execute_model`` sends one step and returns a future of its output at once (an executor that runs the step
    in place returns it done: ``done_future``). The workers run the steps in the order they were sent, so the
    engine may send the next step before the previous one's output is back (``EngineCore.step_with_batch_queue``).
    A failed step's future holds the error."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]: ...

    def shutdown(self) -> None: ...


def done_future(output: ModelRunnerOutput) -> Future[ModelRunnerOutput]:
    """A future that already holds ``output``: what an executor that runs a step in place returns."""
    future: Future[ModelRunnerOutput] = Future()
    future.set_result(output)
    return future
