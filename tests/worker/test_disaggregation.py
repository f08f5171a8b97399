"""Prefill/decode disaggregation offline (scheduler/requests/kv_transfer.py, scheduler/kv/offload.py's pulls,
worker/kv/shared.py): a producer ``LLM`` and a consumer ``LLM`` in one process over one shared folder, as two
engines of a node. The consumer's greedy tokens equal an engine's that computed the prompt itself, while its prompt
came from the producer's published blocks (counted); a block that cannot be pulled (the producer gone, another
model, never published) is computed, never served wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_llama import make_tiny_llama

from cbserve import LLM, SamplingParams
from cbserve.scheduler.requests.kv_transfer import KVTransferParams

ARGS: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=8, block_size=4,
                            kv_cache_memory_bytes=256 * 1024, max_num_batched_tokens=128, progress=False)  # fmt: skip
MIB = 1 / 1024  # GiB
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1] + [100 + 29 * c + i for i in range(40 + c)] for c in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("pd") / "tiny")


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    llm = LLM(str(model), **ARGS)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm.shutdown()
    return out


def _engine(model: Path, folder: Path, role: str, **extra: Any) -> LLM:
    pd = {"kv_role": role, "shm_path": str(folder), "pull_wait_s": 0.5, **extra}
    return LLM(str(model), kv_offloading_size=MIB, disaggregation=pd, **ARGS)


@pytest.mark.parametrize("family", ["qwen2_bias", "mistral", "qwen3", "gemma2", "gemma3", "phi3_long"])
def test_every_family_decodes_a_pulled_prompt_as_it_decodes_its_own(family: str, tmp_path: Path) -> None:
    from family_testlib import FAMILIES, make_family_model
    from worker_testlib import make_tiny_model

    folder = make_family_model(tmp_path / family, family) if family in FAMILIES else \
        make_tiny_model(tmp_path / family, family)  # fmt: skip
    prompts = [[1] + [10 + 7 * c + i for i in range(36 + 5 * c)] for c in range(2)]
    plain = LLM(str(folder), **ARGS)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    plain.shutdown()
    producer, consumer = _engine(folder, tmp_path / "shm", "kv_producer"), _engine(folder, tmp_path / "shm",
                                                                                   "kv_consumer")
    got = [consumer.generate([p], GREEDY, use_tqdm=False, kv_transfer_params=_prefill(producer, p))[0]
           .outputs[0].token_ids for p in prompts]  # fmt: skip
    assert got == want
    assert consumer.engine.scheduler.offload.stats.blocks_pulled == sum((len(p) - 1) // 4 for p in prompts)
    for llm in (producer, consumer):  # nothing held: every block of both pools is free again
        kv = llm.engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
        llm.shutdown()


def _prefill(producer: LLM, prompt: list[int]) -> dict[str, Any]:
    out = producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False,
                            kv_transfer_params={"do_remote_decode": True})[0]
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def test_the_decode_engine_pulls_the_prompt_and_gives_the_same_tokens(
    model: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    producer, consumer = _engine(model, tmp_path, "kv_producer"), _engine(model, tmp_path, "kv_consumer")
    name = producer.engine_config.cache.offload.shm_name
    assert (tmp_path / f"{name}.kvshm").exists()
    got = []
    for prompt in PROMPTS:
        answer = _prefill(producer, prompt)
        assert answer["remote_engine_id"] == name and answer["do_remote_prefill"] is True
        assert answer["remote_block_ids"] == list(range((len(prompt) - 1) // 4))
        got.append(consumer.generate([prompt], GREEDY, use_tqdm=False, kv_transfer_params=answer)[0]
                   .outputs[0].token_ids)
    assert got == reference
    s = consumer.engine.scheduler.offload.stats
    full = sum((len(p) - 1) // 4 for p in PROMPTS)
    assert s.blocks_pulled == full and s.hit_tokens_remote == 4 * full and s.pull_failures == 0
    assert s.bytes_pulled == full * consumer.executor.runner.kv_tiers.block_bytes
    producer.shutdown()
    assert not (tmp_path / f"{name}.kvshm").exists()  # a producer takes its file with it
    consumer.shutdown()


def test_blocks_that_cannot_be_pulled_are_computed(model: Path, reference: list[list[int]], tmp_path: Path) -> None:
    producer, consumer = _engine(model, tmp_path, "kv_producer"), _engine(model, tmp_path, "kv_consumer")
    answer = _prefill(producer, PROMPTS[0])
    producer.shutdown()  # its file is gone: nothing to pull
    gone = consumer.generate([PROMPTS[0]], GREEDY, use_tqdm=False, kv_transfer_params=answer)[0]
    other = {**answer, "remote_engine_id": "0" * 20 + "-1-abcdef"}  # another model's (or a made-up) producer
    wrong = consumer.generate([PROMPTS[1]], GREEDY, use_tqdm=False, kv_transfer_params=other)[0]
    assert [gone.outputs[0].token_ids, wrong.outputs[0].token_ids] == reference[:2]
    s = consumer.engine.scheduler.offload.stats
    assert s.blocks_pulled == 0 and s.pull_failures >= 2 and s.hit_tokens_remote == 0
    consumer.shutdown()


def test_a_role_refuses_the_other_side_and_bad_params_are_named(model: Path, tmp_path: Path) -> None:
    consumer = _engine(model, tmp_path, "kv_consumer")
    with pytest.raises(Exception, match="publishes no KV"):
        _prefill(consumer, PROMPTS[0])
    consumer.shutdown()
    for raw, why in [({"do_remote_prefill": True, "remote_engine_id": "../etc/x", "remote_block_ids": []},
                      "remote_engine_id"),
                     ({"do_remote_decode": True, "do_remote_prefill": True}, "exclusive"),
                     ({"do_remote_decode": True, "nixl": 1}, "unknown key")]:
        with pytest.raises(ValueError, match=why):
            KVTransferParams.from_json(raw)
