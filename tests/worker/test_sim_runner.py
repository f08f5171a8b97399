"""The simulated engine (``model: sim``): its cost model and its runner, with a fake clock (no sleeping)."""

from __future__ import annotations

import json

import pytest

from cbserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.loading.model_info import converted_folder, locate_model, read_model_info
from cbserve.worker.runner.sim_runner import SIM_FIRST_PLAIN_TOKEN, SIM_VOCAB_SIZE, SimRunner, sim_token
from cbserve.worker.sim_cost import SIM_MODEL, SimCostModel

COST = SimCostModel()


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _runner(fake: FakeTime, **kw: object) -> SimRunner:
    return SimRunner(ModelConfig(model=SIM_MODEL, device="cpu", **kw, block_size=16), sleep=fake.sleep,
                     clock=fake.clock)


def _new(req_id: str, prompt_len: int, computed: int = 0, **sp: object) -> NewRequestData:
    return NewRequestData(req_id, list(range(100, 100 + prompt_len)), prompt_len, SamplingParams(**sp),
                          list(range(-(-prompt_len // 16))), computed)


def test_decode_step_is_weight_bound_and_near_published_figures() -> None:
    one = COST.step_time([(1, 512)], 1)
    assert 5e-3 < one < 8e-3  # ~6.5 ms per decode step of Llama-3-8B on an H100
    many = COST.step_time([(1, 512)] * 64, 64)
    assert one < many < 1.5 * one  # 64 decodes cost little more than one: the weights dominate


def test_prefill_is_compute_bound_and_proportional_to_its_tokens() -> None:
    t2k, t4k = COST.step_time([(2048, 2048)], 1), COST.step_time([(4096, 4096)], 1)
    assert 0.05 < t4k < 0.2
    assert 1.8 < (t4k - COST.step_overhead_s) / (t2k - COST.step_overhead_s) < 2.5  # linear + a little attention
    assert COST.step_time([], 0) == 0.0


def test_kv_read_makes_long_contexts_dearer() -> None:
    assert COST.step_time([(1, 8000)] * 64, 64) > COST.step_time([(1, 100)] * 64, 64) * 1.5


def test_num_blocks_of_an_h100() -> None:
    assert COST.kv_bytes_per_token == 128 * 1024
    blocks = COST.num_blocks(16, 0.9)
    assert 20_000 < blocks < 30_000  # ~400k tokens of KV, as vLLM reports for Llama-3-8B on 80 GB
    assert COST.num_blocks(16, 0.5) < blocks


def test_step_outputs_prefill_then_decode_and_sleeps_for_the_cost() -> None:
    fake = FakeTime()
    runner = _runner(fake)
    runner.init_kv_cache(runner.determine_num_blocks())
    # a 40-token prompt in two chunks: the first chunk samples nothing
    out = runner.execute_model(SchedulerOutput([_new("a", 40)], [], {"a": 32}, 32))
    assert out.req_ids == [] and fake.slept == [pytest.approx(COST.step_time([(32, 32)], 0))]
    out = runner.execute_model(SchedulerOutput([], [CachedRequestData("a", [], [], 32)], {"a": 8}, 8))
    assert out.req_ids == ["a"] and out.sampled_token_ids == [[sim_token(runner.requests["a"].key, 40)]]
    # async scheduling: the next token is scheduled before its sample came back; the worker fills it in
    out = runner.execute_model(SchedulerOutput([], [CachedRequestData("a", [], [], 40)], {"a": 1}, 1))
    assert len(out.sampled_token_ids[0]) == 1 and runner.requests["a"].num_tokens == 42
    assert out.forward_time_s == pytest.approx(COST.step_time([(1, 41)], 1))
    assert runner.busy_s == pytest.approx(sum(fake.slept))


def test_n_forks_logprobs_and_finished_requests() -> None:
    fake = FakeTime()
    runner = _runner(fake)
    new = [_new("n3", 5, n=3), _new("lp", 5, logprobs=2)]
    out = runner.execute_model(SchedulerOutput(new, [], {"n3": 5, "lp": 5}, 10))
    by_id = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    assert len(by_id["n3"]) == 1  # num_samples comes from the scheduler (1 here)
    lp = out.logprobs[out.req_ids.index("lp")]
    assert lp is not None and lp[0].token_id == by_id["lp"][0] and len(lp[0].top) == 2
    fork = NewRequestData("f", [1, 2, 3], 3, SamplingParams(n=2), [0], 0, num_samples=2)
    out = runner.execute_model(SchedulerOutput([fork], [], {"f": 3}, 3, finished_req_ids={"n3"}))
    assert "n3" not in runner.requests and len(out.sampled_token_ids[0]) == 2
    assert runner.requests["f"].num_tokens == 3  # fork point: the scheduler sends the children's tokens


def test_tokens_are_plain_ids_of_the_tokenizer_and_deterministic() -> None:
    ids = {sim_token(k, p) for k in range(50) for p in range(50)}
    assert min(ids) >= SIM_FIRST_PLAIN_TOKEN and max(ids) < SIM_VOCAB_SIZE and len(ids) > 2000
    assert sim_token(7, 9) == sim_token(7, 9) != sim_token(7, 10)


def test_tokenizer_vocabulary_matches_the_bundled_model() -> None:
    folder = converted_folder(locate_model(SIM_MODEL).path)
    if folder is None:
        pytest.skip("the bundled GGUF has not been converted yet")
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == SIM_VOCAB_SIZE
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    special = [t["id"] for t in added if t.get("special")]
    assert special and max(special) < SIM_FIRST_PLAIN_TOKEN <= max(special) + 1  # EOS (2) among them


def test_runner_refuses_what_it_cannot_simulate() -> None:
    fake = FakeTime()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        SimRunner(ModelConfig(model=SIM_MODEL, tensor_parallel_size=2, device="cpu"))
    runner = _runner(fake)
    with pytest.raises(ValueError, match="drafts"):
        runner.execute_model(SchedulerOutput([_new("a", 4)], [], {"a": 4}, 4, scheduled_spec_decode_tokens={"a": [1]}))
    with pytest.raises(ValueError, match="tokens scheduled"):
        runner.execute_model(SchedulerOutput([_new("b", 4)], [], {"b": 5}, 5))


def test_model_info_of_sim_is_llama_3_8b() -> None:
    info = read_model_info(SIM_MODEL)
    assert (info.model_type, info.num_hidden_layers, info.num_key_value_heads, info.head_dim) == ("llama", 32, 8, 128)
    assert info.max_position_embeddings == 8192
