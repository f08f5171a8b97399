"""The sparse MoE block equals HF's MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock with the same random weights,
on the torch and the C kernels, touches only the routed experts, and splits across two ranks exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from worker_testlib import free_port

from cbserve.worker.cpu.linear import NativeWeight, pack_linear_weights
from cbserve.worker.cpu.native import load_cpu_kernels
from cbserve.worker.layers.moe import MoEConfig, SparseMoeBlock, fused_experts, map_expert_name

HIDDEN, INTER, EXPERTS, TOP_K = 48, 40, 8, 3


def _hf_block(family: str, norm_topk: bool = True) -> tuple[torch.nn.Module, MoEConfig]:
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(7)
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                            num_experts_per_tok=TOP_K)
        block, moe = MixtralSparseMoeBlock(cfg), MoEConfig.mixtral(cfg)
    else:
        cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                             num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk)
        block, moe = Qwen3MoeSparseMoeBlock(cfg), MoEConfig.qwen3_moe(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval(), moe


def _ours(hf: torch.nn.Module, moe: MoEConfig, kernels: object = None) -> SparseMoeBlock:
    block = SparseMoeBlock(moe, kernels)  # type: ignore[arg-type]
    state = hf.state_dict()
    block.gate.weight.data.copy_(state["gate.weight"])
    block.load_stacked("gate_up_proj", state["experts.gate_up_proj"])
    block.load_stacked("down_proj", state["experts.down_proj"])
    return block.eval()


CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize(("family", "norm"), CASES, ids=["mixtral", "qwen3_moe_norm", "qwen3_moe_no_norm"])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_block_matches_hf(family: str, norm: bool, native: bool) -> None:
    hf, moe = _hf_block(family, norm)
    kernels = None
    if native:
        kernels = load_cpu_kernels().kernels
        if kernels is None:
            pytest.skip("C kernels unavailable")
    ours = _ours(hf, moe, kernels)
    if native:
        assert pack_linear_weights(ours, kernels) == 2 * EXPERTS
        assert isinstance(ours.experts[0].gate_up_proj.packed, NativeWeight)
    gen = torch.Generator().manual_seed(3)
    for n in (0, 1, 5, 64):
        x = torch.randn(1, n, HIDDEN, generator=gen)
        with torch.inference_mode():
            want = hf(x)[0]
            got = ours(x[0])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Qwen3-MoE without norm_topk_prob really leaves the top-k weights unnormalised
    w, _ = ours.route(x[0])
    assert torch.allclose(w.sum(-1), torch.ones(64)) == moe.renormalize


def test_only_routed_experts_are_read() -> None:
    hf, moe = _hf_block("mixtral")
    ours = _ours(hf, moe)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ours(x)
        _, ids = ours.route(x)
        unrouted = sorted(set(range(EXPERTS)) - set(ids.flatten().tolist()))
        assert len(unrouted) >= EXPERTS - 2 * TOP_K
        for e in unrouted:  # any read of these would turn the output into NaN
            for p in ours.experts[e].parameters():
                p.fill_(float("nan"))
        got = ours(x)
    assert torch.equal(got, want)


def test_fused_experts_equals_a_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(5)
    ours = _ours(*_hf_block("qwen3_moe"))
    x = torch.randn(9, HIDDEN, generator=gen)
    ids = torch.randint(0, EXPERTS, (9, 2), generator=gen)
    w = torch.rand(9, 2, generator=gen)
    with torch.inference_mode():
        got = fused_experts(x, w, ids, ours.experts)
        want = torch.stack([sum(w[t, j] * ours.experts[int(ids[t, j])](x[t : t + 1])[0] for j in range(2))
                            for t in range(9)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_checkpoint_names() -> None:
    assert map_expert_name("model.layers.3.block_sparse_moe.experts.7.w1.weight") == (
        "model.layers.3.mlp.experts.7.gate_up_proj.weight", 0)
    assert map_expert_name("model.layers.3.block_sparse_moe.experts.7.w3.weight") == (
        "model.layers.3.mlp.experts.7.gate_up_proj.weight", 1)
    assert map_expert_name("model.layers.3.block_sparse_moe.experts.7.w2.weight") == (
        "model.layers.3.mlp.experts.7.down_proj.weight", None)
    assert map_expert_name("model.layers.0.block_sparse_moe.gate.weight") == ("model.layers.0.mlp.gate.weight", None)
    assert map_expert_name("model.layers.1.mlp.experts.12.up_proj.weight") == (
        "model.layers.1.mlp.experts.12.gate_up_proj.weight", 1)
    assert map_expert_name("model.layers.1.mlp.gate_proj.weight") is None  # a dense MLP layer
    assert map_expert_name("model.layers.1.self_attn.q_proj.weight") is None


def test_bad_top_k_is_refused() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8, renormalize=True)


def _tp_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        hf, moe = _hf_block("qwen3_moe")
        ours = _ours(hf, moe)
        assert ours.experts[0].down_proj.weight.shape == (HIDDEN, INTER // 2)
        x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            y = ours(x)
        if rank == 0:
            torch.save(y, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tp2_block_equals_tp1(tmp_path: Path) -> None:
    hf, moe = _hf_block("qwen3_moe")
    x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = _ours(hf, moe)(x)
    mp.spawn(_tp_worker, args=(free_port(), str(tmp_path / "y.pt")), nprocs=2, join=True)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), want, atol=1e-5, rtol=1e-5)
