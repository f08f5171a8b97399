"""Turns sampled tokens into sequence state, stop decisions, forks and RequestOutputs.

After each appended token the request's ``StopRule`` (stop.py) decides whether the sequence stops and
why. Beam search (beam_search.py) only decides which beams continue, fork or drop; this module carries
its decisions out. Stop strings are the front end's business: it calls ``EngineCore.finish_request``.
"""

from __future__ import annotations

from cbserve.scheduler.beam_search import BeamStep, exhausted_beams, hypotheses, offer_beam, ready_beam_step
from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.requests.request import RequestOutput, RequestStatus
from cbserve.scheduler.requests.sequence import Sequence, SequenceGroup
from cbserve.scheduler.scheduler import Scheduler
from cbserve.scheduler.spec_decode import rollback
from cbserve.scheduler.stats import FinishedRequestStats, IterationStats, SpecDecodeStats


class SequenceUpdater:
    def __init__(self, scheduler: Scheduler, groups: dict[str, SequenceGroup]) -> None:
        self.scheduler = scheduler
        self.groups = groups

    def store_prompt_logprobs(self, computed: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        """Keep the prompt logprobs a step computed (the first computation of a position wins: a preempted
        request recomputes its prompt)."""
        seqs = self.scheduler.seqs
        for seq_id, (start, entries) in computed.items():
            seq = seqs.get(seq_id)
            store = None if seq is None else seq.group.prompt_logprobs
            if store is None:
                continue
            for pos, entry in enumerate(entries, start):
                if pos < len(store) and store[pos] is None:
                    store[pos] = entry

    # ---- sampled tokens ---------------------------------------------------------------------------
    def process_sampled(
        self,
        seq: Sequence,
        sampled: list[int],
        logprobs: list[TokenLogprob] | None,
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
    ) -> None:
        group = seq.group
        if group.mode == "beam":
            step = offer_beam(seq, sampled, logprobs)
            if step is not None:
                self._apply_beam_step(group, step, now, outputs, it)
            return
        if len(sampled) > 1 and not group.forked and seq.index == 0:
            targets = self._fork(seq, sampled, logprobs)
        else:
            targets = [(seq, sampled[0], logprobs[0] if logprobs else None)]
        for target, token, logprob in targets:
            self.append_token(target, token, logprob, now, outputs, it)

    def _fork(
        self, parent: Sequence, sampled: list[int], logprobs: list[TokenLogprob] | None
    ) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """n > 1: the worker sampled ``num_samples`` tokens from the prompt's last row. Children share
        the parent's blocks (copy-on-write of the partly filled last block happens when written)."""
        group = parent.group
        group.forked = True
        targets = [(parent, sampled[0], logprobs[0] if logprobs else None)]
        for i in range(1, min(len(sampled), group.params.num_sequences)):
            child = group.new_sequence(i, list(parent.token_ids))
            child.last_token_time = parent.last_token_time
            self.scheduler.fork(parent, child)
            targets.append((child, sampled[i], logprobs[i] if logprobs and i < len(logprobs) else None))
        return targets

    def _apply_beam_step(
        self, group: SequenceGroup, step: BeamStep, now: float, outputs: list[RequestOutput], it: IterationStats
    ) -> None:
        for parent, child in step.forks:
            self.scheduler.fork(parent, child)
        for seq in step.dropped:
            self.drop_sequence(seq, now, outputs, it)
        for seq, tlp in step.appends:
            self.append_token(seq, tlp.token_id, tlp, now, outputs, it)
        for seq in exhausted_beams(group):
            self.drop_sequence(seq, now, outputs, it)

    def append_token(
        self,
        seq: Sequence,
        token: int,
        logprob: TokenLogprob | None,
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
    ) -> None:
        """Append one sampled token, check the stop conditions, stream it (per-step hot path)."""
        tokens = seq.token_ids
        tokens.append(token)
        group = seq.group
        times = group.times
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if seq.logprobs is not None:
                seq.logprobs.append(logprob)
        it.num_generation_tokens += 1
        times.num_generation_tokens += 1
        if times.first_token is None:
            times.first_token = now
            it.ttfts.append(now - times.arrival)
            it.num_prompt_tokens += group.num_prompt_tokens
        elif seq.last_token_time is not None:
            it.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        times.last_token = now
        status = group.stop.check(len(tokens), token)
        if group.stream:
            outputs.append(
                RequestOutput(
                    group.req_id,
                    seq.index,
                    [token],
                    [logprob] if group.stream_logprobs and logprob is not None else None,
                    status is not None,
                    None if status is None else status.finish_reason,
                    group.num_prompt_tokens,
                    times.num_cached_tokens,
                    seq.cumulative_logprob if logprob is not None else None,
                    None,
                    take_prompt_logprobs(group),
                    client=group.client,
                )
            )
        if status is not None:
            self.finish_sequence(seq, status, now, outputs, it)

    # ---- pooling ----------------------------------------------------------------------------------
    def finish_pooled(
        self, pooled: dict[str, list[float]], now: float, outputs: list[RequestOutput], it: IterationStats
    ) -> None:
        """A pooling engine: each request whose prompt completed finishes with its embedding (its blocks freed)."""
        seqs = self.scheduler.seqs
        for seq_id, vector in pooled.items():
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            group = seq.group
            times = group.times
            times.first_token = times.last_token = now
            it.num_prompt_tokens += group.num_prompt_tokens
            it.num_embedding_requests += 1
            outputs.append(
                RequestOutput(group.req_id, seq.index, [], None, True, "stop", group.num_prompt_tokens,
                              times.num_cached_tokens, embedding=vector, client=group.client)
            )
            self.finish_sequence(seq, RequestStatus.FINISHED_STOPPED, now, outputs, it)

    # ---- finishing --------------------------------------------------------------------------------
    def append_verified(
        self,
        seq: Sequence,
        sampled: list[int],
        logprobs: list[TokenLogprob] | None,
        num_drafts: int,
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
        spec_stats: SpecDecodeStats,
    ) -> None:
        """Speculative decoding: the worker verified ``num_drafts`` drafts and returned the accepted ones
        plus one token (all kept at the worker). Append them in order until the sequence stops, then roll
        the rejected drafts back."""
        seq.num_sent_tokens += len(sampled)
        spec_stats.record(num_drafts, len(sampled) - 1)
        for j, token in enumerate(sampled):
            lp = logprobs[j] if logprobs and j < len(logprobs) else None
            self.append_token(seq, token, lp, now, outputs, it)
            if seq.status is not RequestStatus.RUNNING:
                return  # stopped (its blocks are freed): the rest is dropped
        rollback(self.scheduler.kv, seq)

    def finish_external(
        self,
        seq: Sequence,
        status: RequestStatus,
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
    ) -> None:
        """Finish from outside (abort, stop string): report it with no new tokens."""
        group = seq.group
        if group.mode == "stream":
            outputs.append(
                RequestOutput(
                    req_id=group.req_id,
                    index=seq.index,
                    new_token_ids=[],
                    new_logprobs=[] if group.params.logprobs is not None else None,
                    finished=True,
                    finish_reason=status.finish_reason,
                    num_prompt_tokens=group.num_prompt_tokens,
                    num_cached_tokens=group.times.num_cached_tokens,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    client=group.client,
                )
            )
        self.finish_sequence(seq, status, now, outputs, it)
        if group.mode == "beam" and group.num_unfinished and status is not RequestStatus.FINISHED_ABORTED:
            step = ready_beam_step(group)  # the other beams may have been waiting for this one only
            if step is not None:
                self._apply_beam_step(group, step, now, outputs, it)

    def finish_sequence(
        self,
        seq: Sequence,
        status: RequestStatus,
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
    ) -> None:
        self.scheduler.finish(seq, status)
        group = seq.group
        group.num_unfinished -= 1
        if group.num_unfinished == 0:
            self._finish_group(group, now, outputs, it)

    def drop_sequence(
        self, seq: Sequence, now: float, outputs: list[RequestOutput], it: IterationStats
    ) -> None:
        """Remove a sequence that is no candidate any more (a beam not chosen): no output of its own."""
        self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        group = seq.group
        group.seqs.remove(seq)
        group.num_unfinished -= 1
        if group.num_unfinished == 0:
            self._finish_group(group, now, outputs, it)

    def _finish_group(
        self, group: SequenceGroup, now: float, outputs: list[RequestOutput], it: IterationStats
    ) -> None:
        times = group.times
        times.finished = now
        if self.groups.get(group.req_id) is group:
            del self.groups[group.req_id]
        if group.kv_transfer is not None and group.kv_transfer.answer is not None:
            _answer_kv_transfer(group, outputs)
        if group.mode != "stream":
            finals = final_outputs(group)
            it.finished.append(
                FinishedRequestStats(finish_reason=finals[0].finish_reason or "abort", times=times)
            )
            outputs.extend(finals)
            return
        reason = group.seqs[0].status.finish_reason or "abort"
        it.finished.append(FinishedRequestStats(finish_reason=reason, times=times))
        # Ended before the fork (abort, or sequence 0 finished from outside while prefilling): the
        # sequences that never came to be are reported finished too, with the same reason.
        for index in range(len(group.seqs), group.params.n):
            outputs.append(
                RequestOutput(
                    req_id=group.req_id,
                    index=index,
                    new_token_ids=[],
                    new_logprobs=[] if group.params.logprobs is not None else None,
                    finished=True,
                    finish_reason=reason,
                    num_prompt_tokens=group.num_prompt_tokens,
                    num_cached_tokens=times.num_cached_tokens,
                    client=group.client,
                )
            )


def take_prompt_logprobs(group: SequenceGroup) -> list | None:
    """The request's prompt logprobs, on its first streamed output only."""
    if group.prompt_logprobs is None or group.prompt_logprobs_sent:
        return None
    group.prompt_logprobs_sent = True
    return group.prompt_logprobs


def final_outputs(group: SequenceGroup) -> list[RequestOutput]:
    """best_of / beam search: the ``n`` best candidates (by cumulative logprob; for beams with the length
    penalty), reported once at the end (``final_token_ids`` and ``new_token_ids`` both hold the whole
    output)."""
    params = group.params
    ranked = hypotheses(group)
    outs = []
    for i in range(params.n):
        hyp = ranked[i] if i < len(ranked) else None
        tokens = [] if hyp is None else hyp.token_ids
        lps = None
        if params.logprobs is not None:
            lps = [] if hyp is None or hyp.logprobs is None else list(hyp.logprobs)
        outs.append(
            RequestOutput(
                req_id=group.req_id,
                index=i,
                new_token_ids=list(tokens),
                new_logprobs=lps,
                finished=True,
                finish_reason="abort" if hyp is None else hyp.finish_reason,
                num_prompt_tokens=group.num_prompt_tokens,
                num_cached_tokens=group.times.num_cached_tokens,
                cumulative_logprob=None if hyp is None else hyp.cumulative_logprob,
                final_token_ids=list(tokens),
                prompt_logprobs=group.prompt_logprobs,
                client=group.client,
            )
        )
    return outs


def _answer_kv_transfer(group: SequenceGroup, outputs: list[RequestOutput]) -> None:
    """A producer's answer (requests/kv_transfer.py) on the request's last output, unless it ended without one (an
    abort or a failure: nothing was published for it)."""
    for out in reversed(outputs):
        if out.req_id == group.req_id:
            if out.finish_reason in ("stop", "length"):
                out.kv_transfer_params = group.kv_transfer.answer  # type: ignore[union-attr]
            return
