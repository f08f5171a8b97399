"""Every architecture family equals HF transformers: a tiny random model of each (sharded safetensors, with a
tokenizer) gives HF generate()'s greedy tokens and its logprobs within 1e-4, on prompts of mixed lengths
longer than the sliding window, through chunked prefill, prefix-cache hits, preemption and requests joining
mid-batch; on the CPU C kernels (native ops, C attention, the one-call layer driver) and on the torch
reference path."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from family_testlib import FAMILIES, MAX_MODEL_LEN, load_hf, make_family_model, prompts
from worker_testlib import hf_greedy, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor

MAX_NEW = 16
# "native": the C kernels' exact float32 products (the int16 activations "auto" picks on CPUs with VNNI are
# checked apart: test_gguf_families.py)
PATHS = {"native": dict(cpu_ops="native", attention_backend="cpu", device="cpu", cpu_decode_activations="float32",
                        cpu_prefill_activations="float32"),
         "torch": dict(cpu_ops="torch", attention_backend="torch", device="cpu")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    folder = make_family_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, load_hf(folder)


def _check_logprobs(hf: object, prompt: list[int], tokens: list[int], logprobs: list, tol: float = 1e-4) -> None:
    seq = prompt + tokens
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)  # type: ignore[operator]
    assert len(logprobs) == len(tokens)
    for j, lp in enumerate(logprobs):
        pos = len(prompt) - 1 + j
        assert lp.token_id == seq[pos + 1]
        assert abs(lp.logprob - ref[pos, lp.token_id].item()) < tol, (pos, lp.logprob, ref[pos, lp.token_id])
        if tol <= 1e-4:
            assert [t for t, _ in lp.top] == ref[pos].topk(3).indices.tolist()
        else:  # near-ties may swap places: each alternative's logprob is HF's, within tol
            assert all(abs(v - ref[pos, t].item()) < tol for t, v in lp.top), (pos, lp.top)


@pytest.mark.parametrize("path", list(PATHS))
def test_family_matches_hf(tiny: tuple, path: str, caplog: pytest.LogCaptureFixture) -> None:
    family, folder, hf = tiny
    batch = prompts(3, min_len=17 if family == "phi3_long" else 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(batch)]
    cfg = ModelConfig(model=str(folder), max_model_len=MAX_MODEL_LEN.get(family), **PATHS[path])
    with caplog.at_level(logging.INFO, logger="cbserve.worker.models.native_layers"):
        executor = LocalExecutor(dataclasses.replace(cfg, block_size=4), num_blocks=36, progress=False)
    runner = executor.runner
    if path == "native":  # the one-call C layer driver runs every family's layers
        assert runner.model.native_layers is not None
        assert not [r for r in caplog.records if "module by module" in r.getMessage()]
    run = run_engine(executor, reqs, block_size=4, num_blocks=36, max_num_batched_tokens=16, max_num_seqs=4,
                     max_model_len=MAX_MODEL_LEN.get(family, 256), join_at_step={"r2": 5, "r5": 9})
    assert run.num_preemptions > 0 and run.prefix_hits > 0
    for rid, prompt, _ in reqs:
        assert run.tokens[rid][0] == hf_greedy(hf, prompt, MAX_NEW), (family, rid)
        _check_logprobs(hf, prompt, run.tokens[rid][0], run.logprobs[rid][0])


def test_text_prompts_through_llm(tiny: tuple) -> None:
    """The folder's tokenizer serves text: ``LLM.generate`` on a text prompt gives HF's greedy continuation,
    detokenized, through the engine's pipelined loop as served (async scheduling: two steps in flight)."""
    from transformers import AutoTokenizer

    from cbserve import LLM

    family, folder, hf = tiny
    tok = AutoTokenizer.from_pretrained(folder)
    text = " ".join(f"w{i}" for i in range(3, 40, 2))  # 19 words: longer than the window
    ids = tok(text)["input_ids"]
    llm = LLM(str(folder), max_model_len=MAX_MODEL_LEN.get(family, 256), num_kv_blocks=64, block_size=4,
              progress=False, async_scheduling=True, device="cpu")
    assert llm.engine.max_in_flight == 2
    try:
        out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    expected = hf_greedy(hf, ids, 8)
    assert out[0].prompt_token_ids == ids and out[0].outputs[0].token_ids == expected
    assert out[0].outputs[0].text == tok.decode(ids + expected)[len(tok.decode(ids)):]  # the continuation's text
