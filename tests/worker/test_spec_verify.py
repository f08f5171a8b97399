"""Verification of speculative drafts (worker/sampling/spec_verify.py): greedy acceptance, rejection sampling that
keeps the target distribution (chi-square on a tiny vocabulary), seeded reproducibility, and rows processed
like the sampler's (penalties over each row's own history)."""

from __future__ import annotations

import math

import pytest
import torch

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.sampling.sampler import Sampler, SamplingRow
from cbserve.worker.sampling.spec_verify import DraftGroup, accept_greedy, accept_random, verify_drafts

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def test_accept_greedy_takes_the_matching_prefix_and_the_target_token() -> None:
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch: the target's token
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([3], []) == [3]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_rejection_sampling_keeps_the_target_distribution(draft: int) -> None:
    """Whatever the (deterministic) draft, the first output token is distributed as the target's p, and
    after an accepted draft the next one as the next row's p."""
    torch.manual_seed(1234)
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    probs = torch.stack([p0, p1, p2])
    trials = 20_000
    first = [0] * 5
    second = [0] * 5
    accepted_first = 0
    for _ in range(trials):
        out = accept_random(probs, [draft, 1], [None, None, None])
        first[out[0]] += 1
        if out[0] == draft and len(out) > 1:
            accepted_first += 1
            second[out[1]] += 1
    assert _chi_square(first, p0.tolist()) < CHI2_999[4], first
    assert _chi_square(second, p1.tolist()) < CHI2_999[4], second
    # the draft is accepted with probability p0[draft]
    rate = accepted_first / trials
    sd = math.sqrt(p0[draft].item() * (1 - p0[draft].item()) / trials)
    assert abs(rate - p0[draft].item()) < 5 * sd


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution() -> None:
    """Drafts drawn from a draft model's q (not one-hot): the output tokens are distributed as the target's
    p at the first position and, after an accepted draft, at the second; draft d is accepted with
    probability sum_d q(d) min(1, p(d) / q(d)) = sum_d min(p(d), q(d)). Target rows unnormalised (x 2)."""
    torch.manual_seed(4321)
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    q0 = torch.tensor([0.4, 0.1, 0.3, 0.0, 0.2])  # far from p0, zero where p0 is not
    q1 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    probs = torch.stack([p0, p1, p1]) * 2.0
    q = torch.stack([q0, q1])
    trials = 20_000
    first, second = [0] * 5, [0] * 5
    accepted_first = 0
    for _ in range(trials):
        drafts = [int(torch.multinomial(q0, 1)), int(torch.multinomial(q1, 1))]
        out = accept_random(probs, drafts, [None, None, None], q)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:
            accepted_first += 1
            second[out[1]] += 1
    assert _chi_square(first, p0.tolist()) < CHI2_999[4], first
    assert _chi_square(second, p1.tolist()) < CHI2_999[4], second
    want = float(torch.minimum(p0, q0).sum())
    sd = math.sqrt(want * (1 - want) / trials)
    assert abs(accepted_first / trials - want) < 5 * sd


def test_a_draft_outside_the_support_is_always_rejected() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    for _ in range(200):
        out = accept_random(probs, [2], [None, None])
        assert len(out) == 1 and out[0] in (0, 1)


def _rows(params: SamplingParams, history: list[int], k: int, drafts: list[int], seed: int | None) -> list:
    return [SamplingRow(params, history + drafts[:j], 2, seed) for j in range(k + 1)]


def test_verify_drafts_greedy_uses_each_rows_penalised_logits() -> None:
    """Row j is processed as the sampler would process it after the drafts before it: a repetition
    penalty over that row's history changes the target token exactly as without speculation."""
    sampler = Sampler([9])
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[0, 3] = 2.0  # row 0: 3 wins
    logits[1, 3] = 2.0  # row 1: 3 would win again, but 3 is in the history now (the accepted draft)
    logits[1, 4] = 1.5
    logits[2, 5] = 3.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    history = [1, 2]
    rows = _rows(params, history, 2, [3, 4], None)
    [(tokens, lps)] = verify_drafts(sampler, logits, rows, [DraftGroup(0, 0, [3, 4])])
    assert tokens == [3, 4, 5]
    assert lps is None
    # the same, one row at a time, without drafts
    expect = []
    hist = list(history)
    for j in range(3):
        t, _ = sampler(logits[j : j + 1], [SamplingRow(params, list(hist), 2, None)])
        expect.append(t[0])
        hist.append(t[0])
    assert tokens == expect


def test_verify_drafts_returns_logprobs_of_the_output_tokens() -> None:
    sampler = Sampler()
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, logprobs=2)
    target = logits.argmax(dim=-1).tolist()
    drafts = [target[0], (target[1] + 1) % 8]  # first accepted, second rejected
    [(tokens, lps)] = verify_drafts(sampler, logits, _rows(params, [1, 2], 2, drafts, None), [DraftGroup(0, 0, drafts)])
    assert tokens == [target[0], target[1]]
    assert lps is not None and [lp.token_id for lp in lps] == tokens
    raw = torch.log_softmax(logits, dim=-1)
    for j, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(raw[j, tokens[j]].item(), abs=1e-5)
        assert lp.rank == 1 and len(lp.top) == 2


def test_seeded_verification_is_reproducible_and_follows_the_seed() -> None:
    sampler = Sampler()
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)
    drafts = [1, 2, 3]

    def run(seed: int | None) -> list[int]:
        rows = _rows(params, [5, 6], 3, drafts, seed)
        return verify_drafts(sampler, logits, rows, [DraftGroup(0, 0, drafts)])[0][0]

    assert run(11) == run(11)
    outs = {tuple(run(s)) for s in range(20)}
    assert len(outs) > 1  # different seeds, different draws


def test_groups_and_plain_rows_share_a_batch() -> None:
    """Two requests with drafts in one call: each verified on its own rows."""
    sampler = Sampler()
    logits = torch.full((5, 6), -5.0)
    for row, tok in enumerate([1, 2, 0, 4, 5]):
        logits[row, tok] = 5.0
    greedy = SamplingParams(temperature=0.0)
    rows = _rows(greedy, [0], 1, [1], None) + _rows(greedy, [0], 2, [4, 4], None)
    out = verify_drafts(sampler, logits, rows, [DraftGroup(0, 0, [1]), DraftGroup(1, 2, [4, 4])])
    assert out[0][0] == [1, 2]
    assert out[1][0] == [0]
