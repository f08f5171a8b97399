"""EngineCore: ``step() = schedule -> executor.execute_model -> update_from_output``, and the one pipelined loop
over it: ``step_async`` (a host on an event loop: the SchedulerActor) and ``step_with_batch_queue`` (a blocking
host: the offline ``LLM``) are the same turn.

The engine core owns every request's state (``groups``; a request knows the client it came from, and each of its
outputs says so) and is the single source of truth for token ids. It is single-threaded. With async scheduling
(``SchedulerConfig.async_scheduling``) up to two steps are in flight: the next one is scheduled and sent while the
previous one runs at the workers, whose in-order execution fills in the tokens it needs (``outputs.py``);
otherwise one. The executor returns a future per step (``Executor.execute_model``). A step that raised on a live
worker fails its culprits alone (fault_isolation.py). Times: request timestamps use the injected ``clock``
(``EngineRequest.arrival_time``, ``time.monotonic`` seconds, is honoured only when the clock is
``time.monotonic``; otherwise arrival is stamped at ``add_request``); step timing the injected ``timer``.

An idle SchedulerOutput is not executed (``step()`` skips the executor); finished/preempted ids wait for the next one.

Step timing is the engine's own, so that every host reports the same stats: ``schedule_time_s`` is the time spent
in ``schedule()`` plus ``update_from_output()``, ``execute_time_s`` the time from the end of ``schedule()`` to the
start of ``update_from_output()`` (the executor hop, whatever it is; 0 for an empty output) and
``forward_time_s`` the worker's own. With async scheduling (two steps in flight) the execute time starts at the
later of the step's schedule() and the previous update, so overlapped steps are not counted twice. ``totals``
holds the engine's cumulative counters.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from cbserve.scheduler.config import EngineConfig
from cbserve.scheduler.errors import QueueFullError, RequestRejectedError, StepFailedError
from cbserve.scheduler.fault_isolation import FaultIsolation, step_requests
from cbserve.scheduler.integrity import check_engine
from cbserve.scheduler.kv.kv_events import KVCacheEvents
from cbserve.scheduler.outputs import Executor, ModelRunnerOutput, SchedulerOutput, done_future
from cbserve.scheduler.policies import PAUSE_MODES, paused_may_run
from cbserve.scheduler.requests.admission import admit
from cbserve.scheduler.requests.request import EngineRequest, RequestFailure, RequestOutput, RequestStatus
from cbserve.scheduler.requests.sequence import SequenceGroup
from cbserve.scheduler.scheduler import Scheduler, StepState
from cbserve.scheduler.sequence_updater import SequenceUpdater
from cbserve.scheduler.stats import EngineTotals, IterationStats, SchedulerStats, SpecDecodeStats

logger = logging.getLogger(__name__)

# Failed steps in a row after which the workers, not a request, are taken to be broken: the error goes to the host,
# which rebuilds them (a request's fault is isolated in fewer: fault_isolation.py).
MAX_FAILED_STEPS_IN_A_ROW = 8
_REASON_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                  "abort": RequestStatus.FINISHED_ABORTED, "error": RequestStatus.FINISHED_ERROR}  # fmt: skip


async def _no_wait(_: object) -> None:
    return None


def tune_gc_for_serving(young_threshold: int = 50_000) -> None:
    """For a process that hosts an engine: each step allocates thousands of short-lived objects, and
    CPython's default young-generation threshold (700) collects dozens of times per step. Freezing what
    exists (model, config) and raising the threshold cuts the mean scheduler step by about a tenth and
    its p99 more (benchmarks/bench_scheduler.py --default-gc compares)."""
    gc.freeze()
    gc.set_threshold(young_threshold, 50, 50)


@dataclass
class StepResult:
    outputs: list[RequestOutput]  # new tokens per sequence this step; finished ones flagged
    scheduler_stats: SchedulerStats
    iteration_stats: IterationStats
    kv_events: KVCacheEvents | None = None  # prefix-cache changes (EngineCore(kv_events=True)); None: none


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        totals: EngineTotals | None = None,
        kv_events: bool = False,
    ) -> None:
        """``totals``: counters to continue from (e.g. those of the engine this one replaces). ``kv_events``: each
        StepResult carries the prefix-cache blocks stored and evicted (kv_events.py), for a cache-aware router."""
        self.config = config
        self.executor = executor
        self.clock, self.timer = clock, timer  # request timestamps; step timing
        self.scheduler = Scheduler(config, clock)
        if kv_events:
            self.scheduler.kv.record_events()
        self.groups: dict[str, SequenceGroup] = {}
        self.processor = SequenceUpdater(self.scheduler, self.groups)
        self._counter = 0
        self._pending_outputs: list[RequestOutput] = []
        self._pending_iter = IterationStats()
        # One entry per schedule() not yet updated, oldest first (two with async scheduling): its StepState,
        # seconds spent in schedule() and the timer when schedule() returned.
        self._in_flight: deque[tuple[StepState, float, float]] = deque()
        self._updated_at = 0.0  # the timer when the last update_from_output() returned
        self.totals = totals if totals is not None else EngineTotals()
        # Steps sent to the executor and not yet applied, oldest first, with their output's future.
        self.batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self.max_in_flight = 2 if config.scheduler.async_scheduling else 1
        self.isolation = FaultIsolation()  # the search for a failed step's culprit (fault_isolation.py)
        self.failed_in_a_row = 0
        self.weights_version = 0  # the weights' version: 0 as loaded, then each update's (``set_weights_version``)

    # ---- requests in and out ----------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises DuplicateRequestError, RequestRejectedError (admission.py) or QueueFullError (the
        waiting queue is full)."""
        try:
            request, max_tokens = admit(self.config, self.groups, request)
        except RequestRejectedError as e:
            self._pending_iter.rejected_reasons.append(str(e))
            self.totals.num_rejected += 1
            raise
        now = self.clock()
        arrival = request.arrival_time if self.clock is time.monotonic else now
        sc = self.config.scheduler
        group = SequenceGroup(request, self._counter, max_tokens, sc.max_model_len, sc.ordering, arrival, now)
        try:
            self.scheduler.add_sequence(group.seqs[0])
        except QueueFullError:
            self.totals.num_queue_full += 1
            raise
        self._counter += 1
        self.groups[request.req_id] = group
        self.totals.num_admitted += 1

    def abort_request(self, req_id: str) -> None:
        """Abort every sequence of the request; idempotent. The next step reports it finished "abort"."""
        group = self.groups.get(req_id)
        if group is None:
            return
        now = self.clock()
        self.totals.num_aborted += 1
        for seq in list(group.seqs):
            if not seq.is_finished:
                self.processor.finish_external(
                    seq, RequestStatus.FINISHED_ABORTED, now, self._pending_outputs, self._pending_iter
                )

    def finish_request(self, req_id: str, index: int = 0, reason: str = "stop") -> None:
        """Finish one sequence from outside (e.g. the detokenizer saw a stop string). Idempotent."""
        status = _REASON_STATUS.get(reason)
        if status is None:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {sorted(_REASON_STATUS)}")
        group = self.groups.get(req_id)
        seq = None if group is None else group.sequence(index)
        if seq is None or seq.is_finished:
            return
        self.processor.finish_external(seq, status, self.clock(), self._pending_outputs, self._pending_iter)

    # ---- one iteration ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        t0 = self.timer()
        so, st = self.scheduler.schedule()
        if so.scheduled_new_reqs:
            now = self.clock()
            seqs = self.scheduler.seqs
            for new in so.scheduled_new_reqs:
                times = seqs[new.req_id].group.times
                if times.first_scheduled is None:
                    times.first_scheduled = now
                    times.num_cached_tokens = new.num_computed_tokens
        t1 = self.timer()
        self._in_flight.append((st, t1 - t0, t1))
        return so

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> StepResult:
        """Apply the output of the oldest scheduled step not yet updated (``so``)."""
        t0 = self.timer()
        st, schedule_time, scheduled_at = self._in_flight.popleft() if self._in_flight else (None, 0.0, None)
        # from the later of its schedule() and the previous update (overlapped steps queue at the worker)
        execute_time = 0.0 if so.is_idle or scheduled_at is None else t0 - max(scheduled_at, self._updated_at)
        now = self.clock()
        it, self._pending_iter = self._pending_iter, IterationStats()
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.config.scheduler.async_scheduling:  # computed at schedule(): cache the blocks now known
            self.scheduler.cache_computed_blocks(so)
        else:
            self.scheduler.update_after_step(so)
        if out.kv_transfer is not None and self.scheduler.offload is not None:
            self.scheduler.offload.update_connector_output(out.kv_transfer)
        seqs = self.scheduler.seqs
        if out.prompt_logprobs:
            self.processor.store_prompt_logprobs(out.prompt_logprobs)
        if out.pooled:
            self.processor.finish_pooled(out.pooled, now, outputs, it)
        running = RequestStatus.RUNNING
        all_logprobs = out.logprobs
        num_logprobs = len(all_logprobs)
        process = self.processor.process_sampled
        append = self.processor.append_token
        spec = so.scheduled_spec_decode_tokens
        spec_stats = SpecDecodeStats() if spec else None
        for i, (seq_id, sampled) in enumerate(zip(out.req_ids, out.sampled_token_ids, strict=True)):
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not running:
                continue  # finished/aborted/preempted meanwhile
            if seq.num_pending:
                seq.num_pending -= 1  # this is the oldest of the tokens computed ahead
            elif seq.num_computed_tokens != len(seq.token_ids):
                continue  # not at a sampling position
            seq.drafts = out.draft_token_ids.get(seq_id, [])
            if len(sampled) == 1 and seq.group.mode != "beam":
                seq.num_sent_tokens += 1  # the worker keeps its own sample (ModelRunner._keep_samples)
            logprobs = all_logprobs[i] if i < num_logprobs else None
            if spec_stats is not None and seq_id in spec:
                self.processor.append_verified(seq, sampled, logprobs, len(spec[seq_id]), now, outputs, it, spec_stats)
                continue
            if len(sampled) == 1 and seq.group.forked and seq.group.stream:
                append(seq, sampled[0], logprobs[0] if logprobs else None, now, outputs, it)
            else:
                process(seq, sampled, logprobs, now, outputs, it)
        self.totals.count_step(st, spec_stats)
        stats = self._stats(st)
        stats.spec_decode = spec_stats
        stats.schedule_time_s = schedule_time + self.timer() - t0
        stats.execute_time_s = execute_time
        stats.forward_time_s = out.forward_time_s
        self._updated_at = self.timer()
        for output in outputs if self.weights_version else ():  # which weights ran it (an output's default: 0)
            output.weights_version = self.weights_version
        return StepResult(outputs, stats, it, self.scheduler.kv.take_events())

    def step(self) -> StepResult:
        """One step on its own: schedule, run and apply it (never overlapped with another)."""
        so = self.schedule()
        future = done_future(ModelRunnerOutput()) if so.is_idle else self.executor.execute_model(so)
        self.batch_queue.append((so, future))
        return self.complete_oldest_step()

    # ---- the pipelined loop -----------------------------------------------------------------------
    def submit_steps(self) -> None:
        """Schedule and send steps until ``max_in_flight`` are in flight, there is nothing left to run, or a
        step schedules nothing (only aborts to report, or a batching window is open)."""
        while len(self.batch_queue) < self.max_in_flight and self._runnable():
            so = self.schedule()
            future = done_future(ModelRunnerOutput()) if so.is_idle else self.executor.execute_model(so)
            self.batch_queue.append((so, future))
            if so.is_empty:
                return

    def complete_oldest_step(self) -> StepResult:
        """Apply the oldest step in flight; blocks until its output is back. A ``StepFailedError`` fails the
        request(s) responsible, or starts the search for them, and every other request goes on (``_step_failed``);
        any other error of the step is raised (its workers are gone)."""
        so, future = self.batch_queue.popleft()
        try:
            out = future.result()
        except StepFailedError as e:
            return self._step_failed(so, e)
        self.failed_in_a_row = 0
        result = self.update_from_output(so, out)
        if self.isolation.active:
            self.isolation.on_outputs(result.outputs, self.groups)
            self.scheduler.held = self.isolation.held
        return result

    def _step_failed(self, so: SchedulerOutput, error: StepFailedError) -> StepResult:
        """A step raised on a live worker (fault_isolation.py): drop it and the steps sent after it, preempt their
        requests' sequences (recomputed later), fail the culprits named or found, go on with the next epoch."""
        self.failed_in_a_row += 1
        if self.failed_in_a_row > MAX_FAILED_STEPS_IN_A_ROW:
            raise error
        dropped = [so, *(s for s, _ in self.batch_queue)]
        self.cancel_steps()
        sched = self.scheduler
        if sched.offload is not None:
            sched.offload.steps_dropped([s.kv_transfer for s in dropped if s.kv_transfer is not None])
        sched.epoch += 1
        sched.resend_removals(set().union(*(s.finished_req_ids | s.preempted_req_ids for s in dropped)))
        failed, fresh = step_requests(so, self._request_of)
        affected = {r for s in dropped for r in step_requests(s, self._request_of)[0]}
        sched.preempt_running([seq for r in affected if r in self.groups for seq in self.groups[r].seqs])
        live = [r for r in failed if r in self.groups]
        named = list(dict.fromkeys(self._request_of(s) for s in error.culprits))
        culprits = named or (self.isolation.on_failure(live, fresh) if live else [])
        logger.warning("a step failed (%s): %d request(s) recomputed, failing %s%s", error, len(affected),
                       culprits or "none yet", "" if named else f", suspects {self.isolation.suspects}")
        for req_id in culprits:
            self._fail_request(req_id, RequestFailure(f"the request failed in the model's step ({error})",
                                                      error.client_error))
        sched.held = self.isolation.held
        self.totals.num_failed_steps += 1
        it, self._pending_iter = self._pending_iter, IterationStats()
        outputs, self._pending_outputs = self._pending_outputs, []
        return StepResult(outputs, self._stats(None), it)

    def _request_of(self, seq_id: str) -> str:
        seq = self.scheduler.seqs.get(seq_id)
        return seq.group.req_id if seq is not None else seq_id

    def _fail_request(self, req_id: str, failure: RequestFailure) -> None:
        """End every sequence of the request with finish reason "error" and ``failure`` (its blocks are freed)."""
        group = self.groups.get(req_id)
        if group is None:
            return
        start, now = len(self._pending_outputs), self.clock()
        for seq in list(group.seqs):
            if not seq.is_finished:
                self.processor.finish_external(seq, RequestStatus.FINISHED_ERROR, now, self._pending_outputs,
                                               self._pending_iter)
        for out in self._pending_outputs[start:]:
            out.error = failure

    async def step_async(self, wait: Callable[[Future[ModelRunnerOutput] | None], Awaitable[object]]
                         ) -> StepResult | None:
        """One turn of the loop, for a host on an event loop (the SchedulerActor): send what can be sent, then
        ``await wait(future)`` for the oldest step's output (requests come in meanwhile; ``wait(None)``: the only
        step runs nothing, a batching window is open) and apply it. None when there was nothing to run."""
        self.submit_steps()
        if not self.batch_queue:
            return None
        so, future = self.batch_queue[0]
        window = so.is_idle and len(self.batch_queue) == 1  # nothing runs or follows: a batching window is open
        await wait(None if window else future)
        return self.complete_oldest_step()

    def step_with_batch_queue(self) -> StepResult | None:
        """``step_async`` for a blocking host (the offline ``LLM``): the same turn, which never suspends here (the
        oldest step's future is waited for in ``complete_oldest_step``)."""
        turn = self.step_async(_no_wait)
        try:
            turn.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        raise RuntimeError("step_async suspended with a blocking host")

    def cancel_steps(self) -> None:
        """Forget the steps in flight (their worker group is gone): their futures are cancelled."""
        for _, future in self.batch_queue:
            future.cancel()
        self.batch_queue.clear()
        self._in_flight.clear()

    def has_work(self) -> bool:
        return bool(self.batch_queue) or self._runnable()

    def _runnable(self) -> bool:  # requests the scheduler may run now (not all held by a pause), outputs to tell, or
        mode = self.scheduler.pause_mode  # blocks to store in the KV tiers (a producer publishes a prompt's there)
        if self._pending_outputs or mode is None:
            return self.has_unfinished_requests() or bool(self.scheduler.kv.completed)
        return mode == "wait" and bool(paused_may_run("wait", None, self.scheduler.seqs))

    # ---- pause, prefix cache, weights (an RL loop's rollouts) -------------------------------------
    def pause(self, mode: str = "keep") -> None:
        """Hold the engine until ``resume``: "keep" runs nothing (requests keep their KV), "abort" ends every request
        (finish reason "abort"), "wait" runs the started ones to their end (``drained()``). New ones wait."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}")
        if mode == "abort":
            for req_id in list(self.groups):
                self.abort_request(req_id)
        self.scheduler.pause_mode = "wait" if mode == "wait" else "keep"

    def resume(self) -> None:
        self.scheduler.pause_mode = None

    def drained(self) -> bool:  # no started request left, no step in flight: a pause "wait" is done
        return not self.batch_queue and not paused_may_run("wait", None, self.scheduler.seqs)

    def drop_kv(self) -> None:
        """The KV cache's contents go (sleep): the running sequences are preempted (recomputed after), no cached
        block is served again. Only with no step in flight."""
        if self.batch_queue:
            raise RuntimeError("drop_kv with steps in flight")
        self.scheduler.preempt_running(list(self.scheduler.running))
        self.scheduler.kv.reset_prefix_cache()

    def set_weights_version(self, version: int) -> None:  # new weights: no block computed before is served again
        self.weights_version = version
        self.scheduler.kv.reset_prefix_cache()

    def _stats(self, st: StepState | None) -> SchedulerStats:
        return SchedulerStats.of(self.scheduler, st, self.config.scheduler.max_loras, self.totals.num_steps)

    # ---- introspection ----------------------------------------------------------------------------
    def current_stats(self) -> SchedulerStats:
        """The scheduler state now, without a step (no tokens scheduled): for gauges while idle."""
        return self._stats(None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    def check_integrity(self) -> None:
        check_engine(self)
