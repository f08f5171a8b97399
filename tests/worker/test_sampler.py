"""Unit tests of the batched sampler: one feature at a time."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.cpu.native import load_cpu_kernels
from cbserve.worker.sampling.sampler import Sampler, SamplingRow, _top_p, draw

EOS = 2


def _row(params: SamplingParams, history: list[int] | None = None, prompt_len: int | None = None,
         seed: int | None = None) -> SamplingRow:
    history = history if history is not None else [5, 6]
    return SamplingRow(params, history, len(history) if prompt_len is None else prompt_len, seed)


def _sample_many(logits: torch.Tensor, params: SamplingParams, n: int) -> Counter:
    """n draws with distinct seeds (one batched call)."""
    rows = [_row(params, seed=s) for s in range(n)]
    tokens, _ = Sampler([EOS])(logits.expand(n, -1).clone(), rows)
    return Counter(tokens)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    tokens, lps = Sampler()(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 5


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temp in (0.5, 1.0, 2.0):
        counts = _sample_many(logits, SamplingParams(temperature=temp), 4000)
        expected = torch.softmax(logits[0] / temp, -1)
        for tok in range(4):
            assert abs(counts[tok] / 4000 - expected[tok].item()) < 0.03, (temp, tok)


def test_draw_maps_each_uniform_to_its_cumulative_mass_interval() -> None:
    # masses 0, 1, 0, 2, 1 (unnormalised, total 4): cumulative 0 | 1 | 1 | 3 | 4
    probs = torch.tensor([[0.0, 1.0, 0.0, 2.0, 1.0]]).expand(7, -1)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.5, 0.7499, 0.75, 1.0 - 2.0**-53], dtype=torch.float64)
    # u * 4 in [0, 1) -> token 1, [1, 3) -> token 3, [3, 4) -> token 4; zero-mass tokens never; the largest
    # uniform torch draws (1 - 2^-53) stays below the total
    assert draw(probs, u).tolist() == [1, 1, 3, 3, 3, 4, 4]
    # u = 1, outside [0, 1): the last token of positive mass, never a zero-mass one or an index past the row
    assert draw(probs[:1], torch.ones(1, dtype=torch.float64)).tolist() == [4]
    assert draw(torch.tensor([[0.0, 1.0, 2.0, 0.0]]), torch.ones(1, dtype=torch.float64)).tolist() == [2]


def test_draw_matches_the_distribution_over_a_large_vocabulary() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(1, 8192) * 3, -1)
    probs[0, probs[0] < 1e-5] = 0.0  # masked tokens, as top-k / top-p / min-p leave them
    tokens = torch.cat([draw(probs.expand(2500, -1), torch.rand(2500, dtype=torch.float64)) for _ in range(8)])
    top = probs[0].topk(5)
    for p, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        share = p / probs[0].sum().item()
        assert abs((tokens == tok).double().mean().item() - share) < 4 * math.sqrt(share / 20000) + 1e-3
    assert bool((probs[0][tokens] > 0).all())


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -0.5, 2.7]])
    counts = _sample_many(logits, SamplingParams(temperature=1.0, top_k=2), 500)
    assert set(counts) == {0, 1}


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    counts = _sample_many(logits, SamplingParams(temperature=1.0, top_p=0.75), 2000)
    assert set(counts) == {0, 1}  # 0.5 < 0.75 so token 1 is needed; 0.8 >= 0.75 stops there
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04


def _nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    probs, order = logits.softmax(-1).sort(descending=True)
    keep_sorted = (probs.cumsum(-1) - probs) < top_p
    return torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)


@pytest.mark.parametrize("backend", ["topk", "c_kernel", "sort"])
def test_top_p_nucleus_equals_a_full_sort_whatever_its_size(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # peaked rows end within the first 64 tokens; flatter ones within 512 or 4096; the flattest need the
    # whole row: every round of the top-k search, in one batch, with per-row top_p (1.0: the row untouched);
    # the C kernel's quickselect on the same rows; the accelerators' sort of every row (forced on the CPU)
    kernels = None
    if backend == "sort":
        from cbserve.worker.sampling import sampler

        monkeypatch.setattr(sampler, "_top_p_threshold_by_topk", sampler._top_p_threshold_by_sort)
    if backend == "c_kernel":
        kernels = load_cpu_kernels().kernels
        if kernels is None:
            pytest.skip("no C compiler: the CPU kernels are not built here")
    torch.manual_seed(0)
    logits = torch.randn(8, 8192) * torch.tensor([8.0, 6.0, 3.0, 2.0, 1.0, 0.3, 0.05, 4.0]).unsqueeze(1)
    logits[2, ::3] = float("-inf")  # tokens already masked (top_k, a grammar): probability 0
    logits[3, 100:200] = logits[3, 50]  # ties at many values
    top_ps = [0.9, 0.95, 0.8, 0.9, 0.95, 0.99, 0.5, 1.0]
    out = _top_p(logits, top_ps, kernels)
    sizes = []
    for i, p in enumerate(top_ps):
        # top_p 1.0 keeps the row whole (a float32 cumulative sum reaches 1.0 before the row's end)
        expected = _nucleus_by_full_sort(logits[i], p) if p < 1.0 else torch.ones(8192, dtype=torch.bool)
        assert torch.equal(out[i] > float("-inf"), expected), i
        assert torch.equal(out[i][expected], logits[i][expected])
        sizes.append(int(expected.sum()))
    assert min(sizes[:2]) <= 64 and any(64 < n <= 512 for n in sizes) and any(512 < n <= 4096 for n in sizes)
    assert max(sizes[:7]) > 4096 and sizes[7] == 8192


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    counts = _sample_many(probs.log().unsqueeze(0), SamplingParams(temperature=1.0, min_p=0.2), 2000)
    assert set(counts) == {0, 1}


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    sp = SamplingParams(temperature=1.0, seed=7)
    alone, _ = Sampler()(logits.clone(), [_row(sp, seed=7)])
    others = torch.randn(6, 100)
    batch = torch.cat([others[:3], logits, others[3:]])
    rows = [_row(SamplingParams(temperature=1.0)) for _ in range(3)] + [_row(sp, seed=7)]
    rows += [_row(SamplingParams(temperature=0.7, top_p=0.9), seed=i) for i in range(3)]
    mixed, _ = Sampler()(batch, rows)
    assert mixed[3] == alone[0]
    # a different position (history length) gives an independent draw, the same one each time
    later, _ = Sampler()(logits.clone(), [_row(sp, history=[5, 6, 7], prompt_len=2, seed=7)])
    again, _ = Sampler()(logits.clone(), [_row(sp, history=[5, 6, 7], prompt_len=2, seed=7)])
    assert later == again


def test_repetition_penalty_uses_prompt_and_output() -> None:
    logits = torch.tensor([[0.0, 4.0, 3.0, 3.9, -1.0]])
    sp = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 1 (best) is in the prompt: 4.0 / 2 = 2.0 < 3.9
    tokens, _ = Sampler()(logits.clone(), [_row(sp, history=[1], prompt_len=1)])
    assert tokens == [3]
    # negative logits are multiplied: token 0 seen -> -1.0 * 2 = -2.0 < -1.2
    logits2 = torch.tensor([[-1.0, -1.2, -5.0]])
    tokens, _ = Sampler()(logits2.clone(), [_row(sp, history=[0], prompt_len=1)])
    assert tokens == [1]


def test_frequency_and_presence_penalties_use_output_counts() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.5, 0.0]])
    # token 1 generated twice: frequency 0.3 * 2 = 0.6 -> 4.4 < 4.5
    sp = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    tokens, _ = Sampler()(logits.clone(), [_row(sp, history=[3, 1, 1], prompt_len=1)])
    assert tokens == [2]
    # presence counts once: 5.0 - 0.3 = 4.7 > 4.5
    sp = SamplingParams(temperature=0.0, presence_penalty=0.3)
    tokens, _ = Sampler()(logits.clone(), [_row(sp, history=[3, 1, 1], prompt_len=1)])
    assert tokens == [1]
    # prompt tokens are not penalised by frequency/presence
    sp = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    tokens, _ = Sampler()(logits.clone(), [_row(sp, history=[1, 1], prompt_len=2)])
    assert tokens == [1]


def _penalised_row(row: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """One row's penalties, written out for that row alone."""
    p, vocab = r.params, row.shape[0]
    counts = torch.zeros(vocab)
    for t in r.token_ids[r.num_prompt_tokens :]:
        counts[min(t, vocab - 1)] += 1
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        for t in r.token_ids[: r.num_prompt_tokens]:
            seen[min(t, vocab - 1)] = True
        row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
    return row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_batched_penalties_equal_each_row_penalised_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    cases = [
        (SamplingParams(repetition_penalty=1.3), [1, 2, 3, 4, 4], 3),
        (SamplingParams(temperature=0.0), [5, 6, 7], 2),  # no penalty: untouched
        (SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [9, 9, 9, 10, 11, 11], 2),
        (SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4), [20, 21, 299, 22, 22, 299], 3),
        (SamplingParams(presence_penalty=1.0), [30, 31], 2),  # nothing generated yet
        (SamplingParams(repetition_penalty=1.1, presence_penalty=0.1), list(range(40, 140)) + [500], 100),
    ]
    rows = [_row(sp, history=h, prompt_len=n) for sp, h, n in cases]
    out = Sampler().process(logits.clone(), rows)
    for i, r in enumerate(rows):
        assert torch.equal(out[i], _penalised_row(logits[i], r)), i
    assert torch.equal(out[1], logits[1])
    assert not torch.equal(out[5], logits[5]) and out[5][299] != logits[5][299]  # id 500 counted at the last id


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])  # EOS (2) best, then stop id 3
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    tokens, _ = Sampler([EOS])(logits.clone(), [_row(sp, history=[1, 4], prompt_len=1)])
    assert tokens == [4]  # one output token so far < 2: EOS and 3 masked
    tokens, _ = Sampler([EOS])(logits.clone(), [_row(sp, history=[1, 4, 4], prompt_len=1)])
    assert tokens == [2]


def test_logprobs_are_raw_log_softmax_with_rank_and_top() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=3)),
        _row(SamplingParams(temperature=2.0, logprobs=0, repetition_penalty=1.5), seed=3),
        _row(SamplingParams(temperature=0.0)),
    ]
    tokens, lps = Sampler()(logits.clone(), rows)
    ref = torch.log_softmax(logits, -1)
    assert lps[2] is None
    for i in (0, 1):
        lp = lps[i]
        assert lp is not None and lp.token_id == tokens[i]
        assert math.isclose(lp.logprob, ref[i, tokens[i]].item(), abs_tol=1e-6)
        assert lp.rank == int((ref[i] > ref[i, tokens[i]]).sum()) + 1
    assert lps[0].rank == 1 and [t for t, _ in lps[0].top] == ref[0].topk(3).indices.tolist()
    assert lps[1].top == []


@pytest.mark.parametrize("bad", [{"top_p": 0.0}, {"temperature": -1.0}, {"repetition_penalty": 0.0}])
def test_invalid_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_greedy_tokens_equal_argmax_with_ties_and_infinities() -> None:
    from cbserve.worker.sampling.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 1000), generator=gen).float()  # many ties in every row
    logits[5] = float("-inf")
    logits[6, 10:] = float("-inf")
    logits[7, [3, 900]] = float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[7].item() == 3 and greedy_tokens(logits)[5].item() == 0


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_c_argmax_is_torchs_max_indices_at_every_isa_level(isa: str) -> None:
    """The C kernels' greedy choice (what the sampler uses on CPU) against torch's on rows with ties in every
    row, infinities, a row of -inf, NaNs, a length that is no multiple of any vector width, and strided rows."""
    from cbserve.worker.cpu.native import supported_levels
    from cbserve.worker.sampling.sampler import greedy_tokens

    if isa not in supported_levels():
        pytest.skip(f"this CPU does not run {isa}")
    load = load_cpu_kernels(isa)
    assert load.kernels is not None, load.reason
    gen = torch.Generator().manual_seed(1)
    wide = torch.randint(-3, 4, (40, 1013 + 7), generator=gen).float()  # many ties in every row
    logits = wide[:, :1013]
    logits[5] = float("-inf")
    logits[6, 10:] = float("-inf")
    logits[7, [3, 900]] = float("inf")
    logits[8, 1012] = 9.0  # the last value, in the scalar tail
    logits[9, [17, 500]] = float("nan")
    logits[10, 1000] = float("nan")
    logits[11, :] = 5.0
    expected = logits.max(dim=-1).indices
    assert torch.equal(load.kernels.argmax(logits), expected)
    assert torch.equal(greedy_tokens(logits, load.kernels), expected)
    assert greedy_tokens(logits, load.kernels)[[5, 8, 9, 10, 11]].tolist() == [0, 1012, 17, 1000, 0]
    one = torch.randn(1, 49152, generator=gen)  # a decode step's single row at a real vocabulary size
    assert torch.equal(load.kernels.argmax(one), one.argmax(dim=-1))
