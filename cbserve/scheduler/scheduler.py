"""The iteration-level scheduler: which sequences compute how many tokens this iteration.

The rule (design.md): no prefill phase, no decode phase. Each sequence has ``num_computed_tokens``
chasing ``num_tokens``. Under a token budget and a sequence cap, running sequences go first (one token
in decode, or their next prefill chunk), then waiting ones are admitted while budget, cap and KV blocks
last. When a running sequence cannot get a block, the lowest-priority running sequence is preempted
(recompute): its blocks are freed and it goes back to the front of the waiting queue.

The policy (policies.py) only answers questions: which requests may run this step, and whether prefill
work goes before decodes (then a step decodes only when it found no prefill work).

``running`` is kept sorted by ``Sequence.sort_key`` (arrival order under FCFS, (priority, arrival)
under "priority"), so the victim of a preemption is always ``running[-1]``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from cbserve.scheduler.config import EngineConfig
from cbserve.scheduler.fault_isolation import not_held
from cbserve.scheduler.integrity import check_scheduler
from cbserve.scheduler.kv.kv_cache_manager import NO_HITS, KVCacheManager
from cbserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput, StepState
from cbserve.scheduler.policies import make_policy, paused_may_run
from cbserve.scheduler.requests.lora import lora_admission
from cbserve.scheduler.requests.request import RequestStatus
from cbserve.scheduler.requests.sequence import Sequence
from cbserve.scheduler.spec_decode import drafts_for, make_proposer
from cbserve.scheduler.waiting_queue import make_waiting_queue

_RUNNING = RequestStatus.RUNNING
_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _sort_key(seq: Sequence) -> tuple:
    return seq.sort_key


def _is_prefill(seq: Sequence) -> bool:
    return seq.is_prefill




class Scheduler:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config.scheduler
        self.block_size = config.cache.block_size
        self.kv = KVCacheManager(config.cache, clock)
        self.waiting = make_waiting_queue(config.scheduler.ordering, config.scheduler.max_waiting)
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, by seq id
        self.policy = make_policy(config.scheduler, clock)
        self.num_preempted_waiting = 0
        # Preempted beams, by seq id: their running siblings wait for them (see _readmit_beams).
        self._preempted_beams: dict[str, Sequence] = {}
        self._finished_ids: set[str] = set()  # to tell the worker (sequences it holds state for)
        self._preempted_ids: set[str] = set()
        # After a failed step (fault_isolation.py): the requests (ids) not admitted for now, and the epoch of the
        # steps (the worker runs no step of the epoch that failed after the failure).
        self.held: frozenset[str] = frozenset()
        self.epoch = 0
        self.pause_mode: str | None = None  # "keep" or "wait" while paused (policies.paused_may_run)
        spec = config.speculative
        self.proposer = make_proposer(spec)
        self.offload = self.kv.tiers  # the KV tiers below the pool (kv/offload.py)

    # ---- bookkeeping ------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        """A new request's first sequence joins the waiting queue (QueueFullError: it is full)."""
        self.waiting.add(seq)
        seq.status = RequestStatus.WAITING
        self.seqs[seq.seq_id] = seq

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (tokens already set) shares all of ``parent``'s blocks and computed tokens."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = _RUNNING
        self.seqs[child.seq_id] = child
        bisect.insort(self.running, child, key=_sort_key)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Remove a sequence wherever it is (waiting or running) and free its blocks."""
        if seq.status is _RUNNING:
            self._remove_running(seq)
        elif seq.status in _WAITING_STATES and seq.seq_id in self.seqs:
            self.waiting.remove(seq)
            if seq.status is RequestStatus.PREEMPTED:
                self.num_preempted_waiting -= 1
                self._preempted_beams.pop(seq.seq_id, None)
        self.kv.free(seq.seq_id, seq.group.retention)
        if seq.sent:
            self._finished_ids.add(seq.seq_id)
            seq.sent = False
        seq.status = status
        self.seqs.pop(seq.seq_id, None)

    def _remove_running(self, seq: Sequence) -> None:
        i = bisect.bisect_left(self.running, seq.sort_key, key=_sort_key)
        if i >= len(self.running) or self.running[i] is not seq:
            raise RuntimeError(f"{seq} is not in the running list")
        del self.running[i]

    # ---- one iteration ----------------------------------------------------------------------------
    def schedule(self) -> tuple[SchedulerOutput, StepState]:
        """The one scheduling rule: running sequences first, then admissions; the policy says which
        requests may run, and whether prefill work goes first (decodes only in a step without any)."""
        st = StepState(budget=self.config.max_num_batched_tokens)
        allowed = self.policy.may_run(self.waiting, self.seqs)
        if self.pause_mode is not None:  # paused (EngineCore.pause): nothing, or only what had started
            allowed = paused_may_run(self.pause_mode, allowed, self.seqs)
        if allowed is None or allowed:
            select = None if allowed is None else (lambda seq: seq.group.req_id in allowed)
            admissible = select if not self.held else not_held(self.held, select)  # held ones are all waiting
            lora_gate = self.config.max_loras and len(self.waiting)  # nothing to admit: no adapter set to build
            admit = lora_admission(self.running, self.config.max_loras, admissible) if lora_gate else admissible
            if self.policy.prefill_first:
                self._schedule_running(st, _is_prefill if select is None else (lambda s: s.is_prefill and select(s)))
                self._admit_waiting(st, admit)
                if not st.scheduled:  # no prefill work at all: a decode step
                    self._schedule_running(st, select)
            else:
                self._schedule_running(st, select)
                self._admit_waiting(st, admit)
        so = self._build_output(st)
        if self.offload is not None:
            so.kv_transfer = self.offload.build_connector_meta(self.kv.take_completed())
        if self.config.async_scheduling:
            self._commit(st)
        return so, st

    def _commit(self, st: StepState) -> None:
        """Async scheduling: the scheduled tokens count as computed now (the worker runs steps in order), so
        the next step can be scheduled before this one's output is back. A sequence this step samples gets
        a pending token that the next step may compute (the worker fills its id in), unless its sample is
        special (n > 1 fork point, beam search: the scheduler decides the tokens) or will be its last."""
        for seq, num in st.scheduled:
            seq.num_computed_tokens += num
            pending = seq.num_pending
            if seq.num_computed_tokens == len(seq.token_ids) + pending and seq.num_samples == 1:
                group = seq.group
                if group.mode != "beam" and len(seq.token_ids) + pending + 1 < group.stop.max_len:
                    seq.num_pending = pending + 1

    def cache_computed_blocks(self, so: SchedulerOutput) -> None:
        """Async scheduling: register the full blocks of ``so``'s sequences in the prefix cache, as far as
        their token ids are known (a block filled by a token still pending is registered a step later)."""
        kv = self.kv
        if not kv.enable_caching:
            return
        seqs, bs = self.seqs, self.block_size
        for seq_id in so.num_scheduled_tokens:
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not _RUNNING:
                continue
            computed = min(seq.num_computed_tokens, len(seq.token_ids))
            if computed // bs > len(kv.hashes[seq_id]):
                kv.cache_full_blocks(seq_id, seq.token_ids, computed, seq.group.extra_keys)

    def _schedule_running(self, st: StepState, select: Callable[[Sequence], bool] | None = None) -> None:
        """Give running sequences (optionally only those ``select`` accepts) their next tokens, in
        priority order, preempting from the back when blocks run out. This is the per-step hot path:
        the common decode case (room left in its own last block) is inlined."""
        running = self.running
        max_seqs = self.config.max_num_seqs
        tables = self.kv.tables
        bs = self.block_size
        scheduled = st.scheduled
        budget = st.budget
        i = 0
        while i < len(running) and budget > 0 and len(scheduled) < max_seqs:
            seq = running[i]
            i += 1
            if select is not None and not select(seq):
                continue
            pos = seq.num_computed_tokens
            num_new = len(seq.token_ids) + seq.num_pending - pos
            if num_new > budget:
                num_new = budget
            elif num_new <= 0:  # nothing to compute until a token is appended
                continue
            if num_new == 1 and self.proposer is not None and seq.sent and self._propose(seq, st, budget):
                num_new = len(st.spec[seq.seq_id]) + 1
                st.num_decode_tokens += num_new
                scheduled.append((seq, num_new))
                budget -= num_new
                continue
            table = tables.get(seq.seq_id)
            if table is None or pos + num_new > len(table) * bs or table[pos // bs].ref_cnt != 1:
                while not self._try_allocate(seq, num_new):
                    victim = running[-1]  # lowest priority; never one scheduled this step (index < i)
                    self._preempt(victim, st)
                    if victim is seq:
                        st.budget = budget
                        return
            scheduled.append((seq, num_new))
            budget -= num_new
            if num_new == 1 and pos >= seq.num_prompt_tokens:
                st.num_decode_tokens += 1
            else:
                st.num_prefill_tokens += num_new
        st.budget = budget

    def _propose(self, seq: Sequence, st: StepState, budget: int) -> bool:
        """Drafts for a decoding sequence, KV slots reserved; False: none, or no blocks (never preempts)."""
        drafts = drafts_for(self.proposer, seq, budget, len(self.running))
        if not drafts or not self._try_allocate(seq, 1 + len(drafts)):
            return False
        st.spec[seq.seq_id] = drafts
        st.num_draft_tokens += len(drafts)
        return True

    def _admit_waiting(self, st: StepState, accept: Callable[[Sequence], bool] | None = None) -> None:
        """Admit waiting sequences in queue order while budget, sequence cap and blocks last. With
        ``accept``, sequences it refuses are skipped (they keep their place)."""
        if st.preempted:  # blocks are short: do not admit in the step that had to preempt
            return
        if self._preempted_beams:
            self._readmit_beams(st, accept)
        waiting = self.waiting
        if accept is None and self.offload is None:
            while self._has_room(st) and (seq := waiting.peek()) is not None:
                if not self._admit(seq, st):
                    return
                waiting.pop()
            return
        for seq in waiting.ordered():
            if not self._has_room(st):
                return
            if accept is not None and not accept(seq):
                continue
            admitted = self._admit(seq, st)
            if admitted is None:  # its blocks are on their way from disk (kv/offload.py): the next ones go first
                continue
            if not admitted:
                return
            waiting.remove(seq)

    def _has_room(self, st: StepState) -> bool:
        return st.budget > 0 and len(self.running) < self.config.max_num_seqs

    def _readmit_beams(self, st: StepState, accept: Callable[[Sequence], bool] | None) -> None:
        """A beam waits (holding its running place) until all its siblings were sampled, so a preempted
        beam whose siblings run goes first and may exceed the running cap as forks do; else the siblings
        could wait for it forever with the cap full. The per-step cap and the budget still hold."""
        for seq in sorted(self._preempted_beams.values(), key=_sort_key):
            if st.budget <= 0 or len(st.scheduled) >= self.config.max_num_seqs:
                return
            if accept is not None and not accept(seq):
                continue
            if not any(s.status is _RUNNING for s in seq.group.seqs):
                continue  # no sibling waits for it: it takes its turn in the queue
            if not self._admit(seq, st):
                return
            self.waiting.remove(seq)

    def _admit(self, seq: Sequence, st: StepState) -> bool | None:
        """Allocate blocks for a waiting sequence (taking prefix-cache and KV-tier hits) and mark it running. Does
        not remove it from the waiting queue. None: it waits for its blocks from the disk tier."""
        computed, tiered = NO_HITS, []
        if self.kv.enable_caching and seq.group.prompt_logprobs is None:
            computed = self.kv.get_computed_blocks(seq.token_ids, seq.group.extra_keys)
            if self.offload is not None:  # blocks past the pool's hits that the KV tiers hold
                hits = computed[1]
                tiered, wait = self.offload.get_num_new_matched_tokens(
                    seq.token_ids, seq.group.extra_keys, hits[-1] if hits else None, len(hits), seq.group.kv_transfer)
                if wait:
                    return None  # admitted once they are in the RAM tier
        num_hit = len(computed[0]) * self.block_size
        num_cached = num_hit + len(tiered) * self.block_size
        num_tokens = seq.num_tokens
        num_new = num_tokens - num_cached
        if num_new > st.budget:
            if not self.config.enable_chunked_prefill:
                return False
            num_new = st.budget
        new_blocks = self.kv.allocate_slots(seq.seq_id, num_hit, num_cached - num_hit + num_new, computed)
        if new_blocks is None:
            return False
        if tiered:
            blocks = list(zip(new_blocks[: len(tiered)], tiered, strict=True))  # the tiered blocks come first
            self.offload.update_state_after_alloc(blocks)  # type: ignore[union-attr]
        if seq.status is RequestStatus.PREEMPTED:
            self.num_preempted_waiting -= 1
            self._preempted_beams.pop(seq.seq_id, None)
        seq.num_computed_tokens = num_cached
        seq.status = _RUNNING
        st.prefix_cache_queries += num_tokens
        st.prefix_cache_hits += num_cached
        bisect.insort(self.running, seq, key=_sort_key)
        st.add(seq, num_new)
        return True

    def _try_allocate(self, seq: Sequence, num_new: int) -> bool:
        kv = self.kv
        table = kv.tables.get(seq.seq_id)
        pos = seq.num_computed_tokens
        bs = self.block_size
        if table is not None and pos + num_new <= len(table) * bs and table[pos // bs].ref_cnt == 1:
            return True  # fast path: room in its own partly filled block
        siblings = kv.cow_holders(seq, table, pos // bs) if seq.sent else []
        need = kv.num_blocks_to_allocate(seq.seq_id, pos, num_new) + len(siblings) - (1 if siblings else 0)
        if need > kv.num_free_blocks:
            return False
        idx = pos // self.block_size
        for sibling in siblings:
            kv.copy_on_write(sibling.seq_id, idx)
        return kv.allocate_slots(seq.seq_id, pos, num_new) is not None

    def preempt_running(self, seqs: list[Sequence]) -> None:
        """Preempt these sequences where they run (recomputed later, as when blocks run out): what the engine does
        to the sequences of a failed step (fault_isolation.py)."""
        st = StepState(budget=0)
        for seq in seqs:
            if seq.status is _RUNNING:
                self._preempt(seq, st)

    def resend_removals(self, seq_ids: set[str]) -> None:
        """Tell the worker again to drop these sequences (the finished and preempted ids of steps dropped after a
        failure: the worker may not have run them); dropping an id twice is harmless there."""
        self._finished_ids |= seq_ids

    def _preempt(self, seq: Sequence, st: StepState) -> None:
        self._remove_running(seq)
        self.kv.free(seq.seq_id, seq.group.retention)
        seq.num_computed_tokens = seq.num_pending = 0  # an in-flight sample of it is dropped: recomputed
        seq.status = RequestStatus.PREEMPTED
        if seq.sent:
            self._preempted_ids.add(seq.seq_id)
            seq.sent = False
        if seq.group.mode == "beam":
            self._preempted_beams[seq.seq_id] = seq
        self.waiting.add_front(seq)
        self.num_preempted_waiting += 1
        st.preempted.append(seq)

    def _build_output(self, st: StepState) -> SchedulerOutput:
        so = SchedulerOutput()
        new_reqs, cached_reqs = so.scheduled_new_reqs, so.scheduled_cached_reqs
        num_scheduled = so.num_scheduled_tokens
        tables = self.kv.tables
        total = 0
        for seq, num in st.scheduled:
            table = tables[seq.seq_id]
            tokens = seq.token_ids
            if seq.sent:
                nb = seq.num_sent_blocks
                new_blocks = [b.block_id for b in table[nb:]] if len(table) > nb else []
                new_tokens = tokens[seq.num_sent_tokens :]
                cached_reqs.append(
                    CachedRequestData(seq.seq_id, new_tokens, new_blocks, seq.num_computed_tokens)
                )
            else:
                group = seq.group
                new_reqs.append(NewRequestData(
                    seq.seq_id, list(tokens), seq.num_prompt_tokens, group.worker_params,
                    [b.block_id for b in table], seq.num_computed_tokens, seq.num_samples, seq.seed, group.lora,
                ))  # fmt: skip
                seq.sent = True
            seq.num_sent_tokens = len(tokens)
            seq.num_sent_blocks = len(table)
            num_scheduled[seq.seq_id] = num
            total += num
        so.total_num_scheduled_tokens = total
        so.epoch = self.epoch
        so.block_copies = self.kv.take_block_copies()
        if st.spec:
            so.scheduled_spec_decode_tokens = st.spec
        if total:  # an empty output may be skipped by the caller: keep the ids for the next one
            so.finished_req_ids, self._finished_ids = self._finished_ids, set()
            so.preempted_req_ids, self._preempted_ids = self._preempted_ids, set()
        return so

    def update_after_step(self, so: SchedulerOutput) -> None:
        """The scheduled tokens were computed: advance, and register newly full blocks in the cache. Draft
        tokens are not counted here: ``spec_decode.rollback`` counts the accepted ones once they are appended."""
        seqs = self.seqs
        spec = so.scheduled_spec_decode_tokens
        kv = self.kv
        bs = self.block_size
        caching = kv.enable_caching
        for seq_id, num in so.num_scheduled_tokens.items():
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not _RUNNING:
                continue  # finished or aborted meanwhile
            seq.num_computed_tokens += num - len(spec[seq_id]) if spec and seq_id in spec else num
            if caching and seq.num_computed_tokens // bs > len(kv.hashes[seq_id]):
                kv.cache_full_blocks(seq_id, seq.token_ids, seq.num_computed_tokens, seq.group.extra_keys)

    # ---- introspection ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        check_scheduler(self)
