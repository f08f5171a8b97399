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

This module only decides: ``offer_beam`` (and ``ready_beam_step``) return a ``BeamStep`` (forks, drops,
appended tokens) and ``exhausted_beams`` the beams to drop when the search is over; the output processor
carries them out.
Whether a candidate ends its beam is the request's ``StopRule`` (stop.py), as for every other sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.requests.request import RequestStatus
from cbserve.scheduler.requests.sequence import Sequence, SequenceGroup
from cbserve.scheduler.requests.stop import STOPPED


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


@dataclass
class BeamStep:
    """One round of selection, to be carried out in this order: register the forks with the scheduler
    (the child shares its parent's blocks), drop the beams not chosen, append each beam's next token."""

    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, new child)
    dropped: list[Sequence] = field(default_factory=list)
    appends: list[tuple[Sequence, TokenLogprob]] = field(default_factory=list)


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


def offer_beam(seq: Sequence, sampled: list[int], logprobs: list[TokenLogprob] | None) -> BeamStep | None:
    """Record the top candidates the worker sampled for one beam. Once every live beam of its request
    was sampled at this step, choose the next beams and return what to do; until then None."""
    group = seq.group
    state = group.beam_state
    if not isinstance(state, BeamState):
        state = group.beam_state = BeamState(width=group.params.beam_width)
    lp = logprobs[0] if logprobs else None
    top = list(lp.top[: 2 * state.width]) if lp is not None and lp.top else []
    if not top:
        top = [(sampled[0], lp.logprob if lp is not None else 0.0)]
    state.pending[seq.seq_id] = top
    return ready_beam_step(group)


def ready_beam_step(group: SequenceGroup) -> BeamStep | None:
    """If every live beam of the request was sampled and waits, choose the next beams (also after a
    beam was finished from outside: the others may have been waiting for it only)."""
    state = group.beam_state
    if not isinstance(state, BeamState):
        return None
    live = [s for s in group.seqs if not s.is_finished]
    if live and all(
        s.seq_id in state.pending and s.status is RequestStatus.RUNNING and s.num_computed_tokens == s.num_tokens
        for s in live
    ):
        return _select(group, state, live)
    return None


def _select(group: SequenceGroup, state: BeamState, live: list[Sequence]) -> BeamStep:
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
        if group.stop.check(s.num_tokens + 1, token) is STOPPED:
            if position < width:
                lps = None if s.logprobs is None else [*s.logprobs, tlp]
                state.finished.append(Hypothesis([*s.output_token_ids, token], cum, lps, "stop"))
            continue
        chosen.append((s, tlp))
    step = _fork_plan(group, state, chosen)
    kept = {target.seq_id for target, _ in step.appends}
    step.dropped = [s for s in live if s.seq_id not in kept]
    return step


def _fork_plan(group: SequenceGroup, state: BeamState, chosen: list[tuple[Sequence, TokenLogprob]]) -> BeamStep:
    """A beam chosen once continues itself; each further choice of it becomes a forked child."""
    step = BeamStep()
    used: set[str] = set()
    for s, tlp in chosen:
        if s.seq_id not in used:
            used.add(s.seq_id)
            step.appends.append((s, tlp))
            continue
        child = group.new_sequence(state.next_index, list(s.token_ids))
        state.next_index += 1
        child.cumulative_logprob = s.cumulative_logprob
        child.logprobs = None if s.logprobs is None else list(s.logprobs)
        child.last_token_time = s.last_token_time
        step.forks.append((s, child))
        step.appends.append((child, tlp))
    return step


def exhausted_beams(group: SequenceGroup) -> list[Sequence]:
    """The live beams to drop because none of them can beat the ``width``-th best finished hypothesis
    any more (the search is over); empty while the search goes on."""
    state = group.beam_state
    live = [s for s in group.seqs if not s.is_finished]
    if not live or not isinstance(state, BeamState) or len(state.finished) < state.width:
        return []
    penalty = group.params.length_penalty
    scores = sorted(
        (beam_score(h.cumulative_logprob, len(h.token_ids), penalty) for h in state.finished), reverse=True
    )
    best_live = max(beam_score(s.cumulative_logprob, s.num_output_tokens, penalty) for s in live)
    return live if best_live <= scores[state.width - 1] else []
