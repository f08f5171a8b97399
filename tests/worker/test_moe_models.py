"""Mixtral and Qwen3-MoE: greedy outputs equal HF transformers' generate() token for token and logprobs within
1e-4 (fp32), on the C kernels and on the torch reference path, through a real EngineCore with chunked
prefill, prefix-cache hits, preemption and requests joining mid-batch; the layer driver is declined with one
log line; the tokenizer saved with the model serves ``LLM``; TP=2 equals TP=1."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from moe_testlib import MOE_VARIANTS, make_tiny_moe
from test_model_equivalence import _prompts  # mixed lengths around a shared prefix
from test_tensor_parallel import BLOCK, NUM_BLOCKS, _requests, _worker  # the TP=2 rank loop, shared
from worker_testlib import free_port, hf_greedy, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.layers.moe import SparseMoeBlock
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.runner.model_runner import ModelRunner

MAX_NEW = 16


@pytest.fixture(scope="module", params=MOE_VARIANTS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("cpu_ops", ["auto", "torch"])
def test_greedy_and_logprobs_match_hf(tiny: tuple, cpu_ops: str, caplog: pytest.LogCaptureFixture) -> None:
    folder, hf = tiny
    prompts = _prompts(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    with caplog.at_level(logging.INFO, logger="cbserve.worker.models.native_layers"):
        executor = LocalExecutor(ModelConfig(model=str(folder), device="cpu", cpu_ops=cpu_ops, block_size=4),
                                 num_blocks=40, progress=False)
    model = executor.runner.model
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    if cpu_ops == "auto" and executor.runner.cpu_ops == "native":  # the C layer driver is declined, once
        assert model.native_layers is None
        lines = [r.getMessage() for r in caplog.records if "mixture-of-experts" in r.getMessage()]
        assert len(lines) == 1, lines
    run = run_engine(executor, reqs, block_size=4, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4,
                     join_at_step={"r2": 5, "r5": 9, "r6": 12})
    assert run.num_preemptions > 0 and run.prefix_hits > 0
    for rid, prompt, _ in reqs:
        assert run.tokens[rid][0] == hf_greedy(hf, prompt, MAX_NEW), rid
        seq = prompt + run.tokens[rid][0]
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
        for j, lp in enumerate(run.logprobs[rid][0]):
            pos = len(prompt) - 1 + j
            assert lp.token_id == seq[pos + 1]
            assert abs(lp.logprob - ref[pos, lp.token_id].item()) < 1e-4
            assert [t for t, _ in lp.top] == ref[pos].topk(3).indices.tolist()


def test_sparse_and_dense_layers_follow_the_config(tmp_path: Path) -> None:
    folder = make_tiny_moe(tmp_path / "m", "qwen3_moe_sparse_step")  # decoder_sparse_step=2 over 4 layers
    runner = ModelRunner(ModelConfig(model=str(folder), device="cpu", cpu_ops="torch", block_size=4), progress=False)
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers]
    assert kinds == [False, True, False, True]
    assert [runner.model.spec.window(i) for i in range(4)] == [12] * 4  # use_sliding_window: every layer
    folder = make_tiny_moe(tmp_path / "q", "qwen3_moe")  # mlp_only_layers=[1]
    runner = ModelRunner(ModelConfig(model=str(folder), device="cpu", cpu_ops="torch", block_size=4), progress=False)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers] == [True, False, True]
    assert runner.model.model.layers[0].mlp.moe.renormalize is False  # norm_topk_prob=false
    assert runner.model.spec.window(0) is None  # use_sliding_window false: sliding_window is ignored


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_stacked_expert_checkpoint_loads_like_per_expert(tmp_path: Path, variant: str) -> None:
    """transformers 5 holds the experts stacked ([E, 2 * inter, hidden] gate_up, [E, hidden, inter] down); a
    checkpoint saved from its state_dict loads to the same parameters as the per-expert one."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = make_tiny_moe(tmp_path / "per_expert", variant)
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert any(k.endswith("experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for f in folder.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, stacked / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(stacked / "model.safetensors"))
    a, b = (ModelRunner(ModelConfig(model=str(f), device="cpu", cpu_ops="torch", block_size=4), progress=False).model
            for f in (folder, stacked))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_no_cuda_graphs_for_moe_one_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    from test_cuda_graphs_runner import GraphSafeTorchBackend, stand_in_capture

    from cbserve.worker.loading import model_build as model_build_module

    monkeypatch.setattr(model_build_module, "get_attention_backend", lambda *a, **k: GraphSafeTorchBackend)
    folder = make_tiny_moe(tmp_path / "m", "qwen3_moe")
    runner = ModelRunner(ModelConfig(model=str(folder), device="cpu", cpu_ops="torch", block_size=4, max_num_seqs=4),
                         progress=False)
    log: list[int] = []
    with caplog.at_level(logging.INFO, logger="cbserve.worker.cuda.graphs"):
        runner.init_kv_cache(32, capture=stand_in_capture(log))
    assert runner.graphs is None and log == []  # on CPU; on CUDA the Triton experts are captured (test_moe_triton)
    assert [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()] == [
        "decode steps run eagerly (no CUDA graphs: mixture-of-experts blocks run only the routed experts, "
        "chosen on the host each step)"]


def test_llm_with_the_saved_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cbserve import LLM

    folder = make_tiny_moe(tmp_path / "m", "mixtral")
    text = "w5 w17 w33 w90 w41 w7 w250"
    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(folder).eval(), ids, 8)
    llm = LLM(str(folder), progress=False, max_model_len=128, device="cpu")
    try:
        out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(out[0].outputs[0].token_ids) == want
    assert out[0].outputs[0].text.split() == [f"w{t}" for t in want]


# ---- tensor parallelism ----------------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_tp2_matches_tp1(tmp_path: Path, variant: str) -> None:
    folder = make_tiny_moe(tmp_path / "model", variant)
    executor = LocalExecutor(ModelConfig(model=str(folder), device="cpu", block_size=BLOCK), num_blocks=NUM_BLOCKS,
                             progress=False)
    tp1 = run_engine(executor, _requests(), block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_batched_tokens=16,
                     max_num_seqs=4)
    mp.spawn(_worker, args=(str(folder), free_port(), str(tmp_path / "tp2.pt")), nprocs=2, join=True)
    tp2, _ = torch.load(tmp_path / "tp2.pt")  # (tokens, prompt logprobs): test_tensor_parallel's worker
    assert tp2 == {k: v[0] for k, v in tp1.tokens.items()}
