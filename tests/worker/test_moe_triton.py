"""The CUDA mixture-of-experts path (``cbserve/worker/cuda/moe_triton.py``) against ``moe.fused_experts``: the
device-side
alignment against a plain Python reference, the grouped GEMMs (float32 within float32 rounding, bfloat16/float16
within the rounding of a different float32 accumulation order) for 1, 3, 17 and 64 tokens, 4 and 8 experts, top-1
and top-2, hidden 64 and 96, including experts no token chose; ``SparseMoeBlock`` on that path (forced on) with the
experts' parameters turned into views of the stacked weights; the CUDA-graph decision; an ahead-of-time sm_90
compile; and a whole tiny Mixtral / Qwen3-MoE on CUDA against CPU (skipped without a GPU). Without CUDA the kernels
run on CPU tensors under ``TRITON_INTERPRET=1`` (conftest.py)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from sm90_compile_lib import assert_sm90_builds_fit
from worker_testlib import interpreted_triton

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
triton = pytest.importorskip("triton")

from cbserve.worker.layers import moe  # noqa: E402
from cbserve.worker.layers.moe import HOST_ROUTING, MoEConfig, MoEExpert, SparseMoeBlock, fused_experts  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INTER = 128


@pytest.fixture(scope="module")
def mt() -> ModuleType:
    """moe_triton, interpreted without CUDA (it and triton_fused, whose kernels it calls, re-imported if they were
    imported before the interpreter was switched on; skipped if triton itself was)."""
    from cbserve.worker.cuda import moe_triton, triton_fused

    if not CUDA:
        interpreted_triton(triton_fused, moe_triton, probe="_moe_gemm_kernel")
    return moe_triton


def _align_reference(ids: list[list[int]], num_experts: int, block_m: int) -> tuple[list[int], list[int], int]:
    """(sorted pairs padded per expert with n * k, expert of each block, padded length) by plain Python."""
    flat = [e for row in ids for e in row]
    sorted_ids: list[int] = []
    blocks: list[int] = []
    for e in range(num_experts):
        pairs = [p for p, pe in enumerate(flat) if pe == e]
        padded = -(-len(pairs) // block_m) * block_m
        sorted_ids += pairs + [len(flat)] * (padded - len(pairs))
        blocks += [e] * (padded // block_m)
    return sorted_ids, blocks, len(sorted_ids)


@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
def test_align_matches_python_reference(mt: ModuleType, block_m: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for n, num_experts, k in [(1, 4, 1), (3, 4, 2), (17, 8, 2), (64, 8, 1), (64, 8, 2), (5, 3, 3)]:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(n)])
        ids[ids == 1] = 0  # expert 1 gets no tokens
        sorted_ids, blocks, num_padded = mt.moe_align_block_size(ids.to(DEVICE), num_experts, block_m)
        want_ids, want_blocks, want_len = _align_reference(ids.tolist(), num_experts, block_m)
        bound = -(-mt.max_padded_pairs(n * k, num_experts, block_m) // block_m) * block_m
        assert sorted_ids.shape == (bound,) and blocks.shape == (bound // block_m,)
        assert num_padded.tolist() == [want_len]
        assert sorted_ids.tolist() == want_ids + [n * k] * (bound - want_len)
        nb = len(want_blocks)
        assert blocks[:nb].tolist() == want_blocks
        assert all(0 <= b < num_experts for b in blocks[nb:].tolist())


def _experts(num_experts: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.nn.ModuleList:
    experts = torch.nn.ModuleList(MoEExpert(hidden, INTER) for _ in range(num_experts))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    return experts.to(dtype)


def _routing(n: int, num_experts: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """(weights, ids) of top-k routing where experts 1 and E - 1 are never chosen."""
    logits = torch.randn(n, num_experts, generator=gen)
    logits[:, [1, num_experts - 1]] = -torch.inf
    weights, ids = torch.topk(torch.softmax(logits, -1), k, -1)
    return (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("num_experts", [4, 8])
def test_fused_moe_equals_fused_experts(mt: ModuleType, dtype: torch.dtype, hidden: int, num_experts: int) -> None:
    interpreted = DEVICE == "cpu"
    if interpreted and (num_experts, hidden) not in ((8, 96), (4, 64)) or (
            interpreted and (num_experts, hidden) == (4, 64) and dtype != torch.float32):
        pytest.skip("interpreted: (8 experts, hidden 96) in every dtype and (4, 64) in float32; the whole grid runs "
                    "compiled")
    # compiled: every n x k; interpreted (seconds a launch): one k per n, both k and the largest n covered
    sizes = [(n, k) for n in (1, 3, 17, 64) for k in (1, 2)] if not interpreted else [(1, 1), (3, 2), (17, 2), (64, 1)]
    gen = torch.Generator().manual_seed(hidden + num_experts)
    experts = _experts(num_experts, hidden, dtype, gen)
    w13 = torch.stack([e.gate_up_proj.weight.detach() for e in experts]).to(DEVICE)
    w2 = torch.stack([e.down_proj.weight.detach() for e in experts]).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for n, k in sizes:
        x = (torch.randn(n, hidden, generator=gen) * 2).to(dtype)
        weights, ids = _routing(n, num_experts, k, dtype, gen)
        with torch.inference_mode():
            ref = fused_experts(x, weights, ids, experts)
        out = mt.fused_moe(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE))
        assert out.dtype == dtype and out.shape == ref.shape
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=tol * scale,
                                   msg=lambda m, n=n, k=k: f"n={n} k={k}: {m}")
    assert mt.fused_moe(x[:0].to(DEVICE), w13, w2, weights[:0].to(DEVICE), ids[:0].to(DEVICE)).shape == (0, hidden)


@pytest.mark.cuda
def test_block_on_the_triton_path_uses_views_of_stacked_weights(mt: ModuleType,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SparseMoeBlock with ``use_triton`` forced on: the grouped GEMMs run on stacks built once, every expert's
    parameter a view of them (no second copy), reloads land in the stack, a moved model is restacked."""
    gen = torch.Generator().manual_seed(3)
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=INTER, renormalize=True)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    block = block.to(DEVICE)
    x = torch.randn(9, 64, generator=gen).to(DEVICE)
    with torch.inference_mode():
        ref = fused_experts(x, *block.route(x), block.experts)
    calls: list[int] = []
    fused = mt.fused_moe
    monkeypatch.setattr(moe, "use_triton", lambda t: True)
    monkeypatch.setattr(mt, "fused_moe", lambda *a: calls.append(1) or fused(*a))
    with torch.inference_mode():
        out = block(x)
    assert calls == [1]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w13, w2 = block.stacked_weights()
    assert w13.shape == (4, 2 * INTER, 64) and w2.shape == (4, 64, INTER)
    for i, e in enumerate(block.experts):
        assert e.gate_up_proj.weight.data_ptr() == w13[i].data_ptr()
        assert e.down_proj.weight.data_ptr() == w2[i].data_ptr()
    assert block.stacked_weights()[0] is w13  # built once
    new = torch.randn(2 * INTER, 64, generator=gen)
    loader = block.experts[2].gate_up_proj.weight.weight_loader
    loader(block.experts[2].gate_up_proj.weight, new[:INTER], 0)
    loader(block.experts[2].gate_up_proj.weight, new[INTER:], 1)
    assert torch.equal(w13[2].cpu(), new)
    block.double()
    w13_64, _ = block.stacked_weights()
    assert w13_64.dtype == torch.float64 and block.experts[0].gate_up_proj.weight.data_ptr() == w13_64.data_ptr()


def test_cuda_graphs_decision() -> None:
    """Decode steps of a sparse model are captured on CUDA in a Triton dtype; elsewhere the routing is on the host."""
    cuda = [SimpleNamespace(is_cuda=True, dtype=d) for d in DTYPES]
    assert moe.cuda_graphs_blocker(cuda) is None
    assert moe.cuda_graphs_blocker([*cuda, torch.empty(1)]) == HOST_ROUTING
    assert moe.cuda_graphs_blocker([SimpleNamespace(is_cuda=True, dtype=torch.float64)]) == HOST_ROUTING


_SCRIPT = r"""
from cbserve.worker.cuda import moe_triton as mt
fn = mt._moe_gemm_kernel
for dtype, pairs, row_div in json.loads(sys.argv[1]):
    p = {"bfloat16": "*bf16", "float16": "*fp16"}[dtype]
    tiles = mt.moe_tiles(pairs)
    types = dict(a_ptr=p, b_ptr=p, c_ptr=p, sorted_ids_ptr="*i32", block_experts_ptr="*i32", num_padded_ptr="*i32",
                 n_cols="i32", k_dim="i32", num_pairs="i32",
                 **{a: "i32" for a in fn.arg_names if a.startswith("stride")})
    consts = dict(ROW_DIV=row_div, DOT_PRECISION="tf32", UPCAST=False, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  BLOCK_K=tiles.block_k)
    k, usage = build(fn, types, consts, {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    print("COMPILED", dtype, pairs, row_div, usage)
"""
# (dtype, pairs: the decode tiles or the prefill tiles, ROW_DIV: the gate_up GEMM of top-2 or the down GEMM)
CASES = [[d, pairs, row_div] for d in ("bfloat16", "float16") for pairs in (8, 4096) for row_div in (2, 1)]


@pytest.mark.slow
def test_kernel_compiles_for_sm90() -> None:
    """The grouped GEMM compiles to an sm_90 cubin with the launcher's tiles in bfloat16 and float16, within the
    shared memory of a block, at most 255 registers a thread and no spills to local memory."""
    assert_sm90_builds_fit(_SCRIPT, CASES)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_tiny_moe_model_on_cuda_matches_cpu(tmp_path: Path, variant: str) -> None:
    """Greedy tokens of a whole tiny model, float32, on CUDA (Triton experts, CUDA graphs) equal CPU's."""
    from moe_testlib import make_tiny_moe
    from worker_testlib import run_engine

    from cbserve.scheduler.requests.sampling_params import SamplingParams
    from cbserve.worker.config import ModelConfig
    from cbserve.worker.runner.executor import LocalExecutor

    folder = make_tiny_moe(tmp_path / "m", variant)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    reqs = [(f"r{i}", [3 + (7 * i + j) % 300 for j in range(5 + 6 * i)], greedy) for i in range(4)]
    runs = {}
    for device in ("cpu", "cuda"):
        executor = LocalExecutor(ModelConfig(model=str(folder), device=device, dtype="float32", cpu_ops="torch",
                                             block_size=4), num_blocks=64, progress=False)
        if device == "cuda":
            assert executor.runner.graphs is not None  # the MoE guard is lifted on CUDA
        runs[device] = run_engine(executor, reqs, block_size=4, num_blocks=64, max_num_batched_tokens=16,
                                  max_num_seqs=4)
    assert runs["cuda"].tokens == runs["cpu"].tokens
    for rid, _, _ in reqs:
        for a, b in zip(runs["cuda"].logprobs[rid][0], runs["cpu"].logprobs[rid][0], strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3
