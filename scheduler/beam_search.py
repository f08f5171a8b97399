"""Beam search in the engine, on top of fork and copy-on-write.

Each live beam is a sequence. The worker samples greedily and returns the top-(2*width) logprobs of
each beam (``SequenceGroup.worker_params``). A beam that was sampled waits (it has nothing left to
compute) until every live beam of its request was sampled at the same step; then the best ``width``
continuations by cumulative logprob are chosen over all beams: a beam chosen once continues with its
token, a beam chosen again is forked (the child shares its blocks), a beam not chosen is dropped.
Candidates ending in EOS / a stop token (within the top ``width``) become finished hypotheses. The
chosen tokens reach the worker through ``new_token_ids`` (the scheduler's tokens are the truth).
The search ends when no live beam can beat the ``width``-th best finished hypothesis (scores use
``length_penalty``: cumulative logprob / output length ** length_penalty), or every beam hit its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .outputs import TokenLogprob
from .request import RequestOutput, RequestStatus
from .sequence import Sequence, SequenceGroup
from .stats import IterationStats

if TYPE_CHECKING:
    from .output_processor import OutputProcessor


@dataclass
class Hypothesis:
    """A finished candidate: output token ids and their cumulative logprob."""

    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[TokenLogprob] | None
    finish_reason: str


@dataclass
class BeamState:
    width: int
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # seq id -> top candidates
    finished: list[Hypothesis] = field(default_factory=list)
    next_index: int = 1


def beam_score(cumulative_logprob: float, num_tokens: int, length_penalty: float) -> float:
    return cumulative_logprob / max(1, num_tokens) ** length_penalty


def hypotheses(group: SequenceGroup) -> list[Hypothesis]:
    """All candidates of a finished request: finished hypotheses plus the sequences still in the group
    (ended by length or abort), best first."""
    state = group.beam_state
    out = list(state.finished) if isinstance(state, BeamState) else []
    for seq in group.seqs:
        out.append(
            Hypothesis(
                seq.output_token_ids,
                seq.cumulative_logprob,
                None if seq.logprobs is None else list(seq.logprobs),
                seq.status.finish_reason or "abort",
            )
        )
    if group.mode == "beam":
        penalty = group.params.length_penalty
        out.sort(key=lambda h: beam_score(h.cumulative_logprob, len(h.token_ids), penalty), reverse=True)
    else:
        out.sort(key=lambda h: h.cumulative_logprob, reverse=True)
    return out


class BeamSearch:
    def __init__(self, processor: OutputProcessor) -> None:
        self.processor = processor

    def process(
        self,
        seq: Sequence,
        sampled: list[int],
        logprobs: list[TokenLogprob] | None,
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
    ) -> None:
        group = seq.group
        state = group.beam_state
        if not isinstance(state, BeamState):
            state = group.beam_state = BeamState(width=group.params.beam_width)
        lp = logprobs[0] if logprobs else None
        top = list(lp.top[: 2 * state.width]) if lp is not None and lp.top else []
        if not top:
            top = [(sampled[0], lp.logprob if lp is not None else 0.0)]
        state.pending[seq.seq_id] = top
        live = [s for s in group.seqs if not s.is_finished]
        if all(
            s.seq_id in state.pending
            and s.status is RequestStatus.RUNNING
            and s.num_computed_tokens == s.num_tokens
            for s in live
        ):
            self._select(group, state, live, now, outputs, it)

    def _select(
        self,
        group: SequenceGroup,
        state: BeamState,
        live: list[Sequence],
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
    ) -> None:
        width = state.width
        candidates = []
        for s in live:
            for rank, (token, logprob) in enumerate(state.pending.pop(s.seq_id), start=1):
                candidates.append((s.cumulative_logprob + logprob, s, token, logprob, rank))
        candidates.sort(key=lambda c: c[0], reverse=True)
        chosen: list[tuple[Sequence, TokenLogprob]] = []
        for position, (cum, s, token, logprob, rank) in enumerate(candidates):
            if len(chosen) >= width:
                break
            tlp = TokenLogprob(token, logprob, rank)
            if self._ends(group, s, token):
                if position < width:
                    lps = None if s.logprobs is None else [*s.logprobs, tlp]
                    state.finished.append(Hypothesis([*s.output_token_ids, token], cum, lps, "stop"))
                continue
            chosen.append((s, tlp))
        plan = self._fork_plan(group, state, chosen)
        kept = {target.seq_id for target, _ in plan}
        for s in live:
            if s.seq_id not in kept:
                self.processor.drop_sequence(s, now, outputs, it)
        for target, tlp in plan:
            self.processor.append_token(target, tlp.token_id, tlp, now, outputs, it)
        self._maybe_stop(group, state, now, outputs, it)

    def _fork_plan(
        self, group: SequenceGroup, state: BeamState, chosen: list[tuple[Sequence, TokenLogprob]]
    ) -> list[tuple[Sequence, TokenLogprob]]:
        """A beam chosen once continues itself; each further choice of it becomes a forked child."""
        plan = []
        used: set[str] = set()
        for s, tlp in chosen:
            if s.seq_id not in used:
                used.add(s.seq_id)
                plan.append((s, tlp))
                continue
            child = group.new_sequence(state.next_index, list(s.token_ids))
            state.next_index += 1
            child.cumulative_logprob = s.cumulative_logprob
            child.logprobs = None if s.logprobs is None else list(s.logprobs)
            child.last_token_time = s.last_token_time
            self.processor.scheduler.fork(s, child)
            plan.append((child, tlp))
        return plan

    @staticmethod
    def _ends(group: SequenceGroup, seq: Sequence, token: int) -> bool:
        stop = token == group.eos_token_id or token in group.stop_token_ids
        return stop and seq.num_tokens + 1 > group.min_stop_len

    def _maybe_stop(
        self,
        group: SequenceGroup,
        state: BeamState,
        now: float,
        outputs: list[RequestOutput],
        it: IterationStats,
    ) -> None:
        live = [s for s in group.seqs if not s.is_finished]
        if not live or len(state.finished) < state.width:
            return
        penalty = group.params.length_penalty
        scores = sorted(
            (beam_score(h.cumulative_logprob, len(h.token_ids), penalty) for h in state.finished),
            reverse=True,
        )
        best_live = max(beam_score(s.cumulative_logprob, s.num_output_tokens, penalty) for s in live)
        if best_live <= scores[state.width - 1]:
            for s in live:
                self.processor.drop_sequence(s, now, outputs, it)
