"""The sampler's host synchronisations (issue 37): one device-to-host copy per call whatever the batch asks
for, seeded rows independent of their companions and order and unchanged from the per-row generators they
used to draw from, and the tensor-parallel broadcast of the sampled ids without a pickle."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from worker_testlib import free_port

from cbserve.scheduler.requests.sampling_params import SamplingParams as SP
from cbserve.worker.cpu.native import load_cpu_kernels
from cbserve.worker.parallel import broadcast_token_ids
from cbserve.worker.sampling import sampler as sampler_mod
from cbserve.worker.sampling.sampler import Sampler, SamplingRow, row_generator, row_uniforms

EOS = 2
# Every way a tensor's values reach Python: what costs a device-to-host copy (and a wait) on an accelerator.
_READS = ["tolist", "item", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"]


@contextmanager
def _count_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    calls: list[str] = []

    def wrap(name: str, fn: Callable) -> Callable:
        def counted(*args: object, **kwargs: object) -> object:
            calls.append(name)
            return fn(*args, **kwargs)

        return counted

    with monkeypatch.context() as m:
        for name in _READS:
            m.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        m.setattr(torch, "nonzero", wrap("torch.nonzero", torch.nonzero))
        yield calls


def _batch(seed: int = 1234) -> tuple[torch.Tensor, list[SP], list[list[int]]]:
    """12 rows of 1,000 logits, one of each kind: seeded and not, greedy, top-k/p, min-p, penalties,
    min_tokens, logprobs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, 1000, generator=g) * torch.linspace(0.5, 4.0, 12).unsqueeze(1)
    ps = [SP(temperature=0.7, seed=11), SP(temperature=1.0, top_p=0.9, seed=12), SP(temperature=0.0, logprobs=2),
          SP(temperature=1.3, top_k=20, seed=13, logprobs=3), SP(temperature=1.0, min_p=0.1, seed=14),
          SP(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.4, seed=15),
          SP(temperature=1.0), SP(temperature=0.8, top_p=0.5, top_k=100, min_p=0.02, seed=16, logprobs=0),
          SP(temperature=1.0, min_tokens=4, stop_token_ids=(3, 4), seed=17), SP(temperature=0.5, top_p=0.95),
          SP(temperature=2.0, seed=2**62 + 5), SP(temperature=1.0, repetition_penalty=0.7, seed=0)]
    hist = [[(7 * i + j) % 1000 for j in range(5 + i)] for i in range(12)]
    return logits, ps, hist


def _rows(ps: list[SP], hist: list[list[int]]) -> list[SamplingRow]:
    return [SamplingRow(p, hist[i], 3, p.seed) for i, p in enumerate(ps)]


def _kernels(path: str) -> object:
    if path == "sort":
        return None
    kernels = load_cpu_kernels().kernels
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels are not built here")
    return kernels


_SUBSETS = {
    "greedy": [2],
    "random": [6, 9],
    "seeded": [0, 10, 11],
    "top_p_top_k_min_p": [1, 3, 4, 7],
    "penalties_min_tokens": [5, 8, 11],
    "logprobs": [2, 3, 7],
    "all": list(range(12)),
}


@pytest.mark.parametrize("top_p_path", ["sort", "c_kernel"])
@pytest.mark.parametrize("subset", list(_SUBSETS))
def test_one_host_read_per_call(monkeypatch: pytest.MonkeyPatch, subset: str, top_p_path: str) -> None:
    # "sort": the accelerator's top-p (no kernels, the sort path forced on the CPU); "c_kernel": the CPU's
    kernels = _kernels(top_p_path)
    if top_p_path == "sort":
        monkeypatch.setattr(sampler_mod, "_top_p_threshold_by_topk", sampler_mod._top_p_threshold_by_sort)
    logits, ps, hist = _batch()
    idx = _SUBSETS[subset]
    rows = _rows([ps[i] for i in idx], [hist[i] for i in idx])
    sampler = Sampler([EOS], kernels)  # type: ignore[arg-type]
    sub = logits[idx].clone()
    with _count_host_reads(monkeypatch) as calls:
        packed = sampler.sample(sub, rows)
        assert calls == []  # the device side reads nothing back
        tokens, lps = sampler(sub, rows)
    assert calls == ["tolist"]  # __call__: one copy of everything
    assert len(tokens) == len(rows) and all(isinstance(t, int) for t in tokens)
    assert packed.dim() == 1 and (lps.count(None) == len(rows)) == (packed.dtype == torch.long)
    for r, lp, t in zip(rows, lps, tokens, strict=True):
        assert (lp is None) == (r.params.logprobs is None)
        assert lp is None or (lp.token_id == t and len(lp.top) == r.params.logprobs)


@pytest.mark.parametrize("top_p_path", ["sort", "c_kernel"])
def test_seeded_draws_are_unchanged(monkeypatch: pytest.MonkeyPatch, top_p_path: str) -> None:
    """The tokens the sampler drew before its host syncs were removed (per-row generators, branches on the
    device's values), for a batch of every kind, twice after one global seed (unseeded rows move on)."""
    kernels = _kernels(top_p_path)
    if top_p_path == "sort":
        monkeypatch.setattr(sampler_mod, "_top_p_threshold_by_topk", sampler_mod._top_p_threshold_by_sort)
    logits, ps, hist = _batch()
    sampler = Sampler([EOS], kernels)  # type: ignore[arg-type]
    torch.manual_seed(5)
    first, lps = sampler(logits.clone(), _rows(ps, hist))
    second, _ = sampler(logits.clone(), _rows(ps, hist))
    assert first == [316, 995, 518, 258, 168, 963, 837, 870, 972, 36, 706, 703]
    assert second == [316, 995, 518, 258, 168, 963, 501, 870, 972, 36, 706, 703]
    summary = [None if lp is None else (lp.rank, [t for t, _ in lp.top]) for lp in lps]
    assert summary == [None, None, (1, [518, 483]), (11, [861, 418, 391]), None, None, None, (4, []), None, None,
                       None, None]


def test_seeded_uniforms_are_the_per_row_generators_first_numbers() -> None:
    rows = [SamplingRow(SP(temperature=1.0), list(range(n)), 1, seed)
            for n, seed in [(3, 0), (4, None), (9, 2**63 - 1), (1, 77), (5, None)]]
    u = row_uniforms(rows, torch.device("cpu"))
    for r, value in zip(rows, u.tolist(), strict=True):
        gen = row_generator(r, torch.device("cpu"))
        if gen is not None:
            assert value == torch.rand((), dtype=torch.float64, generator=gen).item()
        assert 0.0 <= value < 1.0


def test_seeded_rows_ignore_their_companions_and_order() -> None:
    logits, ps, hist = _batch()
    seeded = [i for i, p in enumerate(ps) if p.seed is not None]
    kernels = load_cpu_kernels().kernels
    alone = {i: Sampler([EOS], kernels)(logits[i : i + 1].clone(), _rows([ps[i]], [hist[i]]))[0][0] for i in seeded}
    rng = random.Random(0)
    others, _, other_hist = _batch(seed=99)
    for _ in range(6):
        picks = [("s", i) for i in rng.sample(seeded, rng.randint(1, len(seeded)))]
        picks += [("o", i) for i in rng.sample(range(12), rng.randint(0, 6))]
        rng.shuffle(picks)
        batch = torch.stack([(logits if k == "s" else others)[i] for k, i in picks])
        other_ps = [SP(temperature=0.9, top_p=0.8), SP(temperature=0.0), SP(temperature=1.1, seed=rng.randint(0, 99))]
        rows = [SamplingRow(ps[i], hist[i], 3, ps[i].seed) if k == "s"
                else SamplingRow(other_ps[i % 3], other_hist[i], 3, other_ps[i % 3].seed) for k, i in picks]
        tokens, _ = Sampler([EOS], kernels)(batch, rows)
        for (k, i), t in zip(picks, tokens, strict=True):
            if k == "s":
                assert t == alone[i], (i, picks)


def test_draw_never_takes_a_token_without_mass() -> None:
    # the largest uniform torch draws, 1 - 2^-53, times any total stays below it: a token of positive mass
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(256, 64, generator=gen, dtype=torch.float64) ** 8 * torch.logspace(-30, 30, 256).unsqueeze(1)
    probs[probs < probs.quantile(0.7, dim=1, keepdim=True)] = 0.0  # zero-mass tokens in every row
    probs[:, 0] = 0.0
    tokens = sampler_mod.draw(probs, torch.full((256,), 1.0 - 2.0**-53, dtype=torch.float64))
    assert bool((probs.gather(1, tokens.unsqueeze(1)) > 0).all())
    last = probs.shape[1] - 1 - (probs.flip(1) > 0).int().argmax(dim=1)
    assert torch.equal(tokens, last)


# ---- tensor parallelism: the sampled ids go to the other ranks in one tensor broadcast ----------
_TP_CASES = [
    ([[5], [7], [9]], 3),
    ([[1, 2, 3], [], [4]], 6),  # drafts: up to k + 1 ids a request; a request's list may even be empty
    ([[2**40, 0], [49151, 17, 3]], 8),  # room to spare: padded
    ([], 0),
    ([[11]], 1),
]


def _tp_worker(rank: int, port: int, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got = []
        for ids, room in _TP_CASES:
            mine = ids if rank == 0 else None
            got.append(broadcast_token_ids(mine, len(ids), room, torch.device("cpu")))
        if rank == 1:
            torch.save(got, result_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tp_broadcast_gives_rank0s_lists(tmp_path: Path) -> None:
    result_file = str(tmp_path / "rank1.pt")
    mp.spawn(_tp_worker, args=(free_port(), result_file), nprocs=2, join=True)
    assert torch.load(result_file) == [ids for ids, _ in _TP_CASES]


def test_broadcast_on_one_rank_returns_the_lists() -> None:
    ids = [[1, 2], [3]]
    assert broadcast_token_ids(ids, 2, 3, torch.device("cpu")) is ids


# ---- CUDA: no synchronisation but the final copy -----------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("subset", list(_SUBSETS))
def test_cuda_sampling_syncs_only_for_the_final_copy(subset: str) -> None:
    logits, ps, hist = _batch()
    idx = _SUBSETS[subset]
    rows = _rows([ps[i] for i in idx], [hist[i] for i in idx])
    dev_logits = logits[idx].to("cuda")
    sampler = Sampler([EOS])
    sampler.sample(dev_logits.clone(), rows)  # warm-up: lazy CUDA initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = sampler.sample(dev_logits.clone(), rows)
        uniforms = row_uniforms(rows, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, lps = sampler_mod.unpack_samples(packed.tolist(), rows)
    assert all(0 <= t < logits.shape[1] for t in tokens)
    assert [lp is None for lp in lps] == [r.params.logprobs is None for r in rows]
    # a seeded row's uniform is the host generator's: the same as on the CPU
    cpu_u = row_uniforms(rows, torch.device("cpu")).tolist()
    for r, a, b in zip(rows, uniforms.tolist(), cpu_u, strict=True):
        assert r.seed is None or a == b
    greedy = [j for j, r in enumerate(rows) if r.params.greedy]
    cpu_tokens, _ = Sampler([EOS])(logits[idx].clone(), rows)
    assert [tokens[j] for j in greedy] == [cpu_tokens[j] for j in greedy]
