"""Internal state of requests inside the engine core.

A client request (``EngineRequest``) becomes a ``SequenceGroup``; its sequences (``n`` / ``best_of``
samples, beams) are the units the scheduler schedules and the worker sees. Sequence 0 uses the client's
request id; fork children use ``child_seq_id(req_id, index)``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from cbserve.scheduler.requests.request import EngineRequest, RequestStatus
from cbserve.scheduler.requests.sampling_params import MAX_LOGPROBS, SamplingParams
from cbserve.scheduler.requests.stop import StopRule
from cbserve.scheduler.stats import RequestTimes

OutputMode = Literal["stream", "best_of", "beam"]


def child_seq_id(req_id: str, index: int) -> str:
    return req_id if index == 0 else f"{req_id}#{index}"


class Sequence:
    """One token sequence: what the scheduler schedules and the worker holds state for."""

    __slots__ = (
        "seq_id", "group", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens", "status",
        "seed", "sort_key", "sent", "num_sent_tokens", "num_sent_blocks", "cumulative_logprob",
        "logprobs", "last_token_time", "num_pending", "drafts",
    )  # fmt: skip

    def __init__(self, group: SequenceGroup, index: int, token_ids: list[int], seed: int | None) -> None:
        self.seq_id = child_seq_id(group.req_id, index)
        self.group = group
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = group.num_prompt_tokens
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.seed = seed
        # Scheduling order: lower runs first and is preempted last.
        self.sort_key: tuple = (*group.order_key, index)
        self.sent = False  # the worker holds this sequence's state
        self.num_sent_tokens = 0
        self.num_sent_blocks = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list | None = [] if group.keep_logprobs else None
        self.last_token_time: float | None = None
        # async scheduling: tokens sampled by steps still in flight (computed ahead, not yet appended)
        self.num_pending = 0
        self.drafts: list[int] = []  # draft_model: the worker's proposal for the next step (used once)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token remains to compute (prompt or recompute)."""
        computed = self.num_computed_tokens
        return computed < len(self.token_ids) - 1 or computed < self.num_prompt_tokens

    @property
    def num_samples(self) -> int:
        """Tokens the worker samples when this sequence's prompt completes (n>1 fork point)."""
        return 1 if self.group.forked or self.index != 0 else self.group.num_fork_samples

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


class SequenceGroup:
    """Engine-side state of one client request."""

    def __init__(
        self,
        request: EngineRequest,
        counter: int,
        max_tokens: int,
        max_model_len: int,
        ordering: str,
        arrival: float,
        enqueue_time: float,
    ) -> None:
        sp = request.sampling_params
        self.req_id = request.req_id
        self.client = request.client  # who sent it: its outputs go back there (the host's channel index)
        self.params = sp
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.stop = StopRule.for_request(sp, self.num_prompt_tokens, max_tokens, max_model_len, request.eos_token_id)
        self.enqueue_time = enqueue_time  # engine clock at add_request (dynamic batching window)
        self.order_key: tuple = (request.priority, counter) if ordering == "priority" else (counter,)
        self.mode: OutputMode = "beam" if sp.use_beam_search else (
            "best_of" if sp.num_sequences > sp.n else "stream"
        )  # fmt: skip
        self.num_fork_samples = 1 if self.mode == "beam" else sp.num_sequences
        self.keep_logprobs = self.mode != "stream" or sp.logprobs is not None
        self.stream = self.mode == "stream"
        self.stream_logprobs = sp.logprobs is not None
        self.worker_params = _worker_params(sp, self.mode)
        self.lora = request.lora
        self.retention = request.retention  # its prompt's ranges to keep cached (kv/retention.py)
        self.kv_transfer = request.kv_transfer  # prefill/decode disaggregation (kv_transfer.py): pulls, the answer
        self.extra_keys = request.extra_keys  # its first block's prefix-cache keys
        # Prompt logprobs, filled by position as prefill chunks come back (the first token has none); the
        # prompt is then computed, never taken from the prefix cache (a hit has no logits).
        self.prompt_logprobs: list | None = None if sp.prompt_logprobs is None else [None] * self.num_prompt_tokens
        self.prompt_logprobs_sent = False
        self.forked = sp.num_sequences == 1 and self.mode != "beam"
        self.seqs: list[Sequence] = []
        self.num_unfinished = 0
        self.times = RequestTimes(arrival=arrival, num_prompt_tokens=self.num_prompt_tokens)
        self.beam_state: object | None = None  # owned by beam_search.py
        self.new_sequence(0, list(request.prompt_token_ids))  # its first sequence, the prompt (``seqs[0]``)

    def new_sequence(self, index: int, token_ids: list[int]) -> Sequence:
        sp = self.params
        seed = None if sp.seed is None else sp.seed + index
        seq = Sequence(self, index, token_ids, seed)
        self.seqs.append(seq)
        self.num_unfinished += 1
        return seq

    def sequence(self, index: int) -> Sequence | None:
        for seq in self.seqs:
            if seq.index == index:
                return seq
        return None


def _worker_params(sp: SamplingParams, mode: OutputMode) -> SamplingParams:
    """best_of and beam search rank sequences by cumulative logprob, so the worker must return them."""
    if mode == "best_of" and sp.logprobs is None:
        return dataclasses.replace(sp, logprobs=0)
    if mode == "beam":
        want = min(MAX_LOGPROBS, 2 * sp.beam_width)
        if sp.logprobs is None or sp.logprobs < want:
            return dataclasses.replace(sp, logprobs=want)
    return sp
