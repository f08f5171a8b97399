"""The offline ``LLM``'s RL controls: weights pushed in place give HF's greedy tokens with those weights, with prefix
caching on (the prompt cached before the push is not served after it), and the outputs name the version; pause and
sleep refuse generation until resume / wake_up, sleep needs ``enable_sleep_mode``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cbserve import LLM, SamplingParams

PROMPT = list(range(5, 45))  # several KV blocks: a stale prefix hit would change the tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("llm-rl") / "tiny")


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("cpu_ops", ["torch", "auto"])
def test_pushed_weights_give_hf_greedy_tokens_and_no_stale_prefix_hit(tiny: Path, cpu_ops: str) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny), progress=False, device="cpu", dtype="float32", cpu_ops=cpu_ops, block_size=16,
              num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    before = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert before.outputs[0].token_ids == _hf_greedy(hf, PROMPT, 8) and before.outputs[0].weights_version == 0
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    report = llm.update_weights(hf.state_dict())
    assert report["version"] == 1 == llm.weights_version and report["num_tensors"] > 0
    after = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == _hf_greedy(hf, PROMPT, 8) != before.outputs[0].token_ids
    assert after.num_cached_tokens == 0 and after.outputs[0].weights_version == 1
    again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]  # blocks computed after the push are served
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == after.outputs[0].token_ids
    assert llm.reset_prefix_cache() > 0
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_pause_and_sleep_refuse_generation_until_resumed(tiny: Path) -> None:
    llm = LLM(str(tiny), progress=False, device="cpu", dtype="float32", num_kv_blocks=32, enable_sleep_mode=True)
    expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.pause("keep")
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.resume()
    report = llm.sleep(1)
    assert llm.is_sleeping() and report["kv_cache_bytes"] > 0
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    off = LLM(str(tiny), progress=False, device="cpu", dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="sleep mode is off"):
        off.sleep(1)
