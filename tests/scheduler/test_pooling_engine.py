"""A pooling engine (``EngineConfig.runner == "pooling"``) with a fake worker that follows the protocol: every
prompt token is computed exactly once and in order (chunked prefill, async scheduling and preemption included),
each request finishes with the vector the worker pooled at the step that completed its prompt, and its blocks
are freed."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from cbserve.scheduler import (
    CacheConfig,
    EngineConfig,
    EngineCore,
    EngineRequest,
    ModelRunnerOutput,
    RequestRejectedError,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from cbserve.scheduler.outputs import done_future


class PoolingWorker:
    """Keeps each request's tokens and computed count; pools (sum of the tokens, their count) at the prompt's end."""

    def __init__(self) -> None:
        self.reqs: dict[str, tuple[list[int], list[int]]] = {}  # id -> (tokens, [computed])
        self.num_chunks: dict[str, int] = {}

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.num_computed_tokens == 0  # no prefix caching: nothing is skipped
            self.reqs[new.req_id] = (list(new.token_ids), [0])
        for cached in so.scheduled_cached_reqs:
            tokens, computed = self.reqs[cached.req_id]
            assert not cached.new_token_ids and cached.num_computed_tokens == computed[0]
        pooled = {}
        for rid, n in so.num_scheduled_tokens.items():
            tokens, computed = self.reqs[rid]
            assert computed[0] + n <= len(tokens), "computed past the prompt"
            computed[0] += n
            self.num_chunks[rid] = self.num_chunks.get(rid, 0) + 1
            if computed[0] == len(tokens):
                pooled[rid] = [float(sum(tokens)), float(len(tokens))]
        return done_future(ModelRunnerOutput(pooled=pooled))

    def shutdown(self) -> None:
        pass


def _engine(async_scheduling: bool, num_blocks: int = 256, budget: int = 16, max_len: int = 64) -> EngineCore:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_len,
                                  async_scheduling=async_scheduling),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=False),
        runner="pooling",
    )
    return EngineCore(config, PoolingWorker())


def _run(engine: EngineCore, prompts: dict[str, list[int]]) -> dict[str, list[float]]:
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1)))
    vectors: dict[str, list[float]] = {}
    num_pooled = 0
    while engine.has_work():
        result = engine.step_with_batch_queue()
        if result is None:
            continue
        engine.check_integrity()
        num_pooled += result.iteration_stats.num_embedding_requests
        for out in result.outputs:
            assert out.finished and out.finish_reason == "stop" and out.new_token_ids == []
            assert out.req_id not in vectors and out.embedding is not None
            vectors[out.req_id] = out.embedding
    assert num_pooled == len(prompts)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks  # every block freed once pooled
    return vectors


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks", [256, 17])  # 17 blocks of 4: one 64-token prompt at a time
def test_every_prompt_is_pooled_once_over_its_chunks(async_scheduling: bool, num_blocks: int) -> None:
    lengths = [1, 3, 17, 64, 40, 9, 33, 2]
    prompts = {f"r{i}": [(i * 7 + j) % 50 + 1 for j in range(n)] for i, n in enumerate(lengths)}
    engine = _engine(async_scheduling, num_blocks)
    vectors = _run(engine, prompts)
    assert vectors == {rid: [float(sum(p)), float(len(p))] for rid, p in prompts.items()}
    chunks = engine.executor.num_chunks  # type: ignore[attr-defined]
    assert chunks["r3"] >= 4  # 64 tokens in steps of 16


def test_a_preempted_prompt_is_recomputed_and_pooled_whole() -> None:
    engine = _engine(True, num_blocks=6)  # async: b's next chunk is scheduled before a's blocks come back
    prompts = {"a": list(range(1, 11)), "b": list(range(1, 21))}
    assert _run(engine, prompts) == {"a": [55.0, 10.0], "b": [210.0, 20.0]}
    assert engine.totals.num_preemptions > 0


def test_pooling_limits_and_config() -> None:
    engine = _engine(False, max_len=32)
    assert _run(engine, {"full": list(range(1, 33))}) == {"full": [528.0, 32.0]}  # max_model_len tokens fit
    with pytest.raises(RequestRejectedError, match="maximum context length is 32"):
        engine.add_request(EngineRequest("long", list(range(1, 34)), SamplingParams(max_tokens=1)))
    with pytest.raises(RequestRejectedError, match="embeds its input once"):
        engine.add_request(EngineRequest("n2", [1, 2], SamplingParams(n=2, max_tokens=1)))
    with pytest.raises(ValueError, match="enable_prefix_caching off"):
        EngineConfig(runner="pooling")  # prefix caching is on by default


def test_an_aborted_pooling_request_finishes_without_a_vector() -> None:
    engine = _engine(True)
    engine.add_request(EngineRequest("a", list(range(1, 60)), SamplingParams(max_tokens=1)))
    engine.add_request(EngineRequest("b", [5, 6], SamplingParams(max_tokens=1)))
    first = engine.step_with_batch_queue()
    assert first is not None and [o.req_id for o in first.outputs] == []  # "a" took the whole budget
    engine.abort_request("a")
    outputs = []
    while engine.has_work():
        result = engine.step_with_batch_queue()
        outputs += [] if result is None else result.outputs
    got = [(o.req_id, o.finish_reason, o.embedding) for o in outputs]
    assert got == [("a", "abort", None), ("b", "stop", [11.0, 2.0])]
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
