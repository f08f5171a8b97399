"""What the CUDA-graph tests on CPU share: hand-written scheduler outputs (``Driver``) and the comparison of two
runners' outputs (``same_output``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cbserve.scheduler.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams

BLOCK = 4
BLOCKS_PER_REQ = 6
SP = SamplingParams(temperature=0.0, logprobs=2, max_tokens=None)


@dataclass
class Driver:
    """Builds scheduler outputs for hand-written steps; the worker keeps the tokens it samples (they are never
    sent back), as the scheduler's protocol says."""

    prompts: dict[str, list[int]]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)  # tokens the worker knows

    def schedule(self, rids: list[str]) -> SchedulerOutput:
        new, cached, sched = [], [], {}
        for rid in rids:
            if rid not in self.tokens:
                self.tokens[rid], self.computed[rid] = list(self.prompts[rid]), 0
                first = (len(self.tokens) - 1) * BLOCKS_PER_REQ
                blocks = list(range(first, first + BLOCKS_PER_REQ))
                new.append(NewRequestData(rid, list(self.tokens[rid]), len(self.prompts[rid]), SP, blocks, 0))
            else:
                cached.append(CachedRequestData(rid, self.tokens[rid][self.sent[rid]:], [], self.computed[rid]))
            self.sent[rid] = len(self.tokens[rid])
            sched[rid] = len(self.tokens[rid]) - self.computed[rid]
        return SchedulerOutput(new, cached, sched, sum(sched.values()))

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] += n
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.tokens[rid].extend(toks)
            if len(toks) == 1:  # the worker keeps its own sample: never sent back (scheduler/outputs.py)
                self.sent[rid] += 1


def same_output(got: ModelRunnerOutput, want: ModelRunnerOutput) -> None:
    assert got.req_ids == want.req_ids
    assert got.sampled_token_ids == want.sampled_token_ids
    for lg, lw in zip(got.logprobs, want.logprobs, strict=True):
        assert (lg is None) == (lw is None)
        for a, b in zip(lg or [], lw or [], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
