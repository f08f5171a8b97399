"""What CUDA memory profiling budgets beside the forward pass, checked on CPU: the sampler's worst-case step
(every transform and 20 logprobs on every row) and the tokens the CUDA graphs' pools hold activations for.
The profiling itself needs a GPU: ``make gpu-check`` builds its 8B model through it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cbserve.worker.config import ModelConfig
from cbserve.worker.cuda.piecewise_graphs import MAX_PIECEWISE_TOKENS
from cbserve.worker.runner.profiling import WORST_CASE_PARAMS, graph_pool_tokens, profile_sampler
from cbserve.worker.sampling.sampler import Sampler, unpack_samples


def test_the_worst_case_sampling_step_runs_every_transform() -> None:
    p = WORST_CASE_PARAMS
    assert p.temperature > 0 and p.top_p < 1 and p.top_k > 0 and p.min_p > 0 and p.logprobs == 20
    assert p.presence_penalty and p.frequency_penalty and p.repetition_penalty != 1.0
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    packed = profile_sampler(Sampler(eos_token_ids=[]), logits)
    rows = [SimpleNamespace(params=p)] * 6
    tokens, logprobs = unpack_samples(packed.tolist(), rows)  # type: ignore[arg-type]
    assert len(tokens) == 6 and all(0 <= t < 1000 for t in tokens)
    assert all(lp is not None and len(lp.top) == 20 for lp in logprobs)


class _GraphSafe:
    supports_cuda_graphs = True


def _runner(cfg: ModelConfig, batched: int, **kw: object) -> SimpleNamespace:
    fields = dict(config=cfg, max_num_seqs=64, max_num_batched_tokens=batched, lora=None,
                  model=SimpleNamespace(cuda_graphs_blocker=None), backend_cls=_GraphSafe)
    return SimpleNamespace(**(fields | kw))


@pytest.mark.parametrize("eager,mode,want", [
    (True, "full_and_piecewise", 0),
    (False, "full_decode_only", 64),
    (False, "full_and_piecewise", 64 + MAX_PIECEWISE_TOKENS),
])
def test_graph_pool_tokens(eager: bool, mode: str, want: int) -> None:
    """The decode graphs' largest batch plus the piecewise graphs' largest step, each capped by the step
    budget: as many tokens as the pools are captured for, and none where nothing is captured."""
    cfg = ModelConfig(device="cpu", enforce_eager=eager, cudagraph_mode=mode)  # type: ignore[arg-type]
    assert graph_pool_tokens(_runner(cfg, 2048)) == want  # type: ignore[arg-type]
    want_small = 0 if eager else 32 + (32 if mode == "full_and_piecewise" else 0)
    assert graph_pool_tokens(_runner(cfg, 32)) == want_small  # type: ignore[arg-type]
    piecewise = MAX_PIECEWISE_TOKENS if mode == "full_and_piecewise" and not eager else 0
    assert graph_pool_tokens(_runner(cfg, 2048, backend_cls=object)) == piecewise  # type: ignore[arg-type]
    assert graph_pool_tokens(_runner(cfg, 2048, lora=object())) == 0  # type: ignore[arg-type]
    blocked = SimpleNamespace(cuda_graphs_blocker="a host sync")
    assert graph_pool_tokens(_runner(cfg, 2048, model=blocked)) == 0  # type: ignore[arg-type]
