"""Stats dataclasses filled by the engine core every iteration. Nothing here knows about Prometheus:
cluster/ops/metrics.py alone turns these into series."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestTimes:
    """Per-request timestamps (time.monotonic seconds) from which the latency metrics follow."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        dt = self.decode_time
        if dt is None or self.num_generation_tokens < 2:
            return None
        return dt / (self.num_generation_tokens - 1)


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    times: RequestTimes


@dataclass
class SpecDecodeStats:
    """Speculative decoding in one step: sequences that had drafts, drafts proposed and accepted, and
    accepted drafts by position (``accepted_per_pos[j]``: sequences whose draft j was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_accepted:
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return None if not self.num_draft_tokens else self.num_accepted_tokens / self.num_draft_tokens


@dataclass
class LoRAStats:
    """The adapters of an engine with LoRA on (vLLM's ``lora_requests_info``): requests per adapter name in
    the running set and in the waiting queue, and ``max_loras``, the most adapters one step holds."""

    max_loras: int
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, running: Iterable[Any], waiting: Iterable[Any], max_loras: int) -> LoRAStats:
        """From the scheduler's running and waiting sequences (``seq.group.lora``: None for the base model);
        a request counts once however many of its sequences there are."""
        return cls(max_loras, _requests_per_adapter(running), _requests_per_adapter(waiting))


def _requests_per_adapter(seqs: Iterable[Any]) -> dict[str, int]:
    groups = {id(seq.group): seq.group.lora.lora_name for seq in seqs if seq.group.lora is not None}
    counts: dict[str, int] = {}
    for name in groups.values():
        counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass
class SchedulerStats:
    """Gauges and per-iteration counters of one engine replica, one snapshot per step()."""

    num_running: int = 0
    num_waiting: int = 0
    num_preempted_waiting: int = 0  # waiting requests that were preempted and await recompute
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_retained_kv_blocks: int = 0  # free cached blocks a retention hint keeps (kv/retention.py)
    kv_evictions: int = 0  # cached blocks the pool evicted, in all (totals since the engine started)
    kv_hint_evictions: int = 0  # of which with a live retention hint (nothing else was free)
    # counters for this iteration (the metrics layer adds them up)
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found in cache
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    batch_size: int = 0  # sequences scheduled this iteration
    schedule_time_s: float = 0.0  # time spent in schedule() + update_from_output()
    execute_time_s: float = 0.0  # time spent in executor.execute_model() (includes the Ray hop)
    forward_time_s: float = 0.0  # worker-reported forward + sample time
    step_counter: int = 0
    spec_decode: SpecDecodeStats | None = None  # None: no drafts this step
    lora: LoRAStats | None = None  # None: LoRA is off

    @classmethod
    def of(cls, sched: Any, st: Any, max_loras: int, step_counter: int) -> SchedulerStats:
        """The scheduler's state now (``sched``: scheduler.py's Scheduler) and what its step ``st`` (a StepState;
        None: no step) scheduled."""
        kv = sched.kv
        stats = cls(num_running=len(sched.running), num_waiting=len(sched.waiting),
                    num_preempted_waiting=sched.num_preempted_waiting, kv_cache_usage=kv.usage,
                    num_kv_blocks=kv.num_blocks, num_free_kv_blocks=kv.num_free_blocks, step_counter=step_counter,
                    num_retained_kv_blocks=kv.pool.retained.num, kv_evictions=kv.pool.num_evictions,
                    kv_hint_evictions=kv.pool.num_retained_evictions)
        if max_loras:
            stats.lora = LoRAStats.of(sched.running, sched.waiting.ordered(), max_loras)
        if st is not None:
            stats.prefix_cache_queries, stats.prefix_cache_hits = st.prefix_cache_queries, st.prefix_cache_hits
            stats.num_prefill_tokens, stats.num_decode_tokens = st.num_prefill_tokens, st.num_decode_tokens
            stats.num_preemptions, stats.batch_size = len(st.preempted), len(st.scheduled)
        return stats


@dataclass
class EngineTotals:
    """Cumulative counters of an engine (the SchedulerActor's /stats reports them). An engine built to
    replace another may continue its totals (``EngineCore(..., totals=old.totals)``)."""

    num_admitted: int = 0  # requests add_request accepted
    num_rejected: int = 0  # refused because they could never run (RequestRejectedError)
    num_queue_full: int = 0  # refused because the waiting queue was full (QueueFullError)
    num_aborted: int = 0  # unfinished requests aborted (abort_request)
    num_failed_steps: int = 0  # steps that raised on a live worker (fault_isolation.py)
    num_steps: int = 0  # update_from_output() calls, empty steps included
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found there
    spec_num_drafts: int = 0  # speculative decoding: sequence-steps that had drafts
    spec_num_draft_tokens: int = 0  # draft tokens proposed
    spec_num_accepted_tokens: int = 0  # of which accepted

    def count_step(self, st: Any, spec: SpecDecodeStats | None = None) -> None:
        """One more step (``st``: its StepState, None for none; ``spec``: its drafts)."""
        self.num_steps += 1
        if spec is not None:
            self.spec_num_drafts += spec.num_drafts
            self.spec_num_draft_tokens += spec.num_draft_tokens
            self.spec_num_accepted_tokens += spec.num_accepted_tokens
        if st is not None:
            self.prefix_cache_queries += st.prefix_cache_queries
            self.prefix_cache_hits += st.prefix_cache_hits
            self.num_preemptions += len(st.preempted)

    @property
    def spec_acceptance_rate(self) -> float | None:
        if not self.spec_num_draft_tokens:
            return None
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens


@dataclass
class IterationStats:
    """What happened to requests during one step: the source of latency histograms and counters."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token (or embedding) this step
    num_embedding_requests: int = 0  # requests of a pooling engine that got their embedding this step
    ttfts: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    rejected_reasons: list[str] = field(default_factory=list)
