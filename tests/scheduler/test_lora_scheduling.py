"""The scheduler's LoRA rule: a step never holds more than ``max_loras`` distinct adapters (waiting requests of
another adapter wait, running ones are never evicted), every request still finishes with its tokens, and
prefix-cache entries are never shared across adapters."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_fakes import expected_tokens, make_engine, req, run

from cbserve.scheduler import LoRARequest, ModelRunnerOutput, RequestRejectedError, SchedulerOutput

ADAPTERS = [None] + [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 6)]


def _watch(executor: object) -> list[set[int]]:
    """Record each step's distinct adapters (from the requests the worker was sent)."""
    lora_of: dict[str, int | None] = {}
    steps: list[set[int]] = []
    inner = executor.execute_model  # type: ignore[attr-defined]

    def execute_model(so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        for new in so.scheduled_new_reqs:
            lora_of[new.req_id] = None if new.lora is None else new.lora.lora_int_id
        steps.append({lora_of[r] for r in so.num_scheduled_tokens if lora_of[r] is not None})  # type: ignore[misc]
        return inner(so)

    executor.execute_model = execute_model  # type: ignore[attr-defined]
    return steps


@settings(max_examples=40, deadline=None)
@given(
    max_loras=st.integers(1, 3),
    adapters=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    lengths=st.lists(st.integers(1, 30), min_size=12, max_size=12),
    num_blocks=st.sampled_from([12, 64]),
)
def test_a_step_holds_at_most_max_loras_adapters(max_loras: int, adapters: list[int], lengths: list[int],
                                                 num_blocks: int) -> None:
    engine, executor = make_engine(max_loras=max_loras, num_blocks=num_blocks, max_batched=24, max_seqs=6)
    steps = _watch(executor)
    requests = []
    for i, a in enumerate(adapters):
        r = req(f"r{i}", lengths[i], max_tokens=6, lora=ADAPTERS[a])
        requests.append(r)
        engine.add_request(r)
    col = run(engine)
    assert max(len(s) for s in steps) <= max_loras
    for r in requests:
        assert col.tokens[(r.req_id, 0)] == expected_tokens(r.prompt_token_ids, 6)


def test_prefix_cache_is_per_adapter() -> None:
    engine, _ = make_engine(max_loras=2)
    prompt = list(range(100, 117))
    for rid, lora in (("base", None), ("a1", ADAPTERS[1]), ("a1-again", ADAPTERS[1]), ("a2", ADAPTERS[2])):
        r = req(rid, prompt, max_tokens=2, lora=lora)
        engine.add_request(r)
        hits = sum(res.scheduler_stats.prefix_cache_hits for res in run(engine).results)
        assert hits == (16 if rid == "a1-again" else 0), rid


def test_an_adapter_on_an_engine_without_lora_is_refused() -> None:
    engine, _ = make_engine()
    r = req("x", 4, lora=ADAPTERS[1])
    with pytest.raises(RequestRejectedError, match="LoRA is not enabled"):
        engine.add_request(r)
