"""Property tests: random add / step / abort / finish / n>1 against the fake worker, which checks the
protocol and the KV contents. Invariants are checked after every operation."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_fakes import Collected, Overlapped, collect, make_engine, req, run

from cbserve.scheduler import QueueFullError, RequestRejectedError, SpeculativeConfig

PREFIXES = [[7, 7, 7, 7, 7, 7, 7, 7, 7], [1, 2, 3, 4, 5, 6], []]

configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4]),
        "kv_tokens": st.integers(24, 80),  # cache size in tokens: num_blocks = kv_tokens // block_size
        "max_batched": st.integers(8, 40),
        "max_seqs": st.integers(1, 6),
        "policy": st.sampled_from(["continuous", "prefill_first", "static", "dynamic"]),
        "ordering": st.sampled_from(["fcfs", "priority"]),
        "caching": st.booleans(),
        "max_model_len": st.just(32),
        "max_waiting": st.integers(2, 30),
    }
)

requests = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, len(PREFIXES) - 1),
        "tail": st.lists(st.integers(0, 400), min_size=0, max_size=8),
        "max_tokens": st.integers(1, 12),
        "n": st.integers(1, 3),
        "extra_best_of": st.integers(0, 1),
        "priority": st.integers(0, 2),
        "salt": st.sampled_from([None, "s"]),
        "min_tokens": st.integers(0, 2),
        "eos_at": st.one_of(st.none(), st.integers(1, 6)),
        "beam": st.integers(0, 4),  # 0: beam search (when the width allows it)
    }
)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), requests),
        st.tuples(st.just("add"), requests),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.integers(0, 3)),
    ),
    max_size=60,
)


def _sized(config: dict) -> dict:
    cfg = dict(config)
    cfg["num_blocks"] = cfg.pop("kv_tokens") // cfg["block_size"]
    return cfg


def build(i: int, spec: dict) -> object:
    prompt = PREFIXES[spec["prefix"]] + spec["tail"]
    best_of = spec["n"] + spec["extra_best_of"] if spec["extra_best_of"] else None
    beam = {}
    if spec.get("beam") == 0 and (best_of or spec["n"]) >= 2:
        beam = {"use_beam_search": True, "temperature": 0.0}
    return req(
        f"r{i}",
        prompt,
        max_tokens=spec["max_tokens"],
        n=spec["n"],
        best_of=best_of,
        priority=spec["priority"],
        salt=spec["salt"],
        min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
        **beam,
    )


SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
DRAFT = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="/fake-draft")


@pytest.mark.parametrize("mode", ["sync", "async-scheduling", "speculative", "draft-model"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, operations=ops)
def test_random_operations_keep_invariants(mode: str, config: dict, operations: list) -> None:
    """With async scheduling the next step is scheduled (and run by the in-order fake worker, which checks
    every KV slot it reads) before the previous step's output is applied. With speculative decoding the
    fake model copies (drafts are accepted and rejected) and the fake worker verifies the drafts: rollback
    keeps every invariant and leaks no block. With a draft model the fake worker proposes the drafts."""
    overlap = mode == "async-scheduling"
    spec = {"speculative": SPEC, "draft-model": DRAFT}.get(mode)
    engine, ex = make_engine(
        dynamic_batch_window_s=0.0, async_scheduling=overlap, speculative=spec, copying=spec is not None,
        draft_k=3 if mode == "draft-model" else 0, **_sized(config),
    )  # fmt: skip
    driver = Overlapped(engine) if overlap else None
    col = Collected()
    accepted: dict[str, int] = {}
    for i, op in enumerate(operations):
        if op[0] == "add":
            r = build(i, op[1])
            if op[1]["eos_at"] is not None:
                ex.eos_after[r.req_id] = op[1]["eos_at"]
            try:
                engine.add_request(r)
                accepted[r.req_id] = r.sampling_params.n
            except (RequestRejectedError, QueueFullError):
                pass
        elif op[0] == "step":
            for _ in range(op[1]):
                for res in [engine.step()] if driver is None else driver.step():
                    collect(res, col)
                engine.check_integrity()
        elif op[0] == "abort" and accepted:
            engine.abort_request(sorted(accepted)[op[1] % len(accepted)])
        elif op[0] == "finish" and accepted:
            engine.finish_request(sorted(accepted)[op[1] % len(accepted)], op[2], "stop")
        engine.check_integrity()
    run(engine, max_steps=5000, into=col, driver=driver)
    _events(ex)
    for req_id, n in accepted.items():
        for index in range(n):
            assert (req_id, index) in col.reasons, f"{req_id}[{index}] never finished"
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.tables
    assert not engine.scheduler.seqs and not engine.groups
    pending = engine.scheduler._finished_ids | engine.scheduler._preempted_ids
    assert set(ex.reqs) <= pending
    if spec is not None:
        event(f"drafts accepted: {ex.num_accepted > 0}, rejected: {ex.num_accepted < ex.num_verified}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, specs=st.lists(requests, min_size=1, max_size=8), k=st.integers(1, 5),
       draft=st.booleans())
def test_speculation_gives_same_tokens(config: dict, specs: list, k: int, draft: bool) -> None:
    """Speculative decoding (n-gram, or a draft model's proposals from the fake worker) on a small cache
    (preemption, chunked prefill, prefix hits, n > 1 forks) gives the tokens greedy decoding gives without
    it on a big cache; drafts are accepted and rejected."""
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    if draft:
        spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model="/fake-draft")
    results = []
    for kv_tokens, speculative in ((1000, None), (config["kv_tokens"], spec)):
        cfg = _sized(dict(config, kv_tokens=kv_tokens, max_waiting=100))
        engine, ex = make_engine(dynamic_batch_window_s=0.0, speculative=speculative, copying=True,
                                 draft_k=k if draft and speculative else 0, **cfg)
        accepted = set()
        for i, item in enumerate(specs):
            r = build(i, dict(item, beam=1))  # beam search is refused with speculation
            if item["eos_at"] is not None:
                ex.eos_after[r.req_id] = item["eos_at"]
            try:
                engine.add_request(r)
                accepted.add(r.req_id)
            except RequestRejectedError:
                pass
        col = run(engine, max_steps=5000)
        kv = engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks and not kv.tables
        results.append((accepted, col.tokens, col.reasons, ex))
    (big_ids, big_toks, big_reasons, _), (ids, toks, reasons, ex) = results
    assert ids <= big_ids
    for key, tokens in toks.items():
        assert big_toks[key] == tokens, key
        assert big_reasons[key] == reasons[key]
    event(f"drafts accepted: {ex.num_accepted > 0}, rejected: {ex.num_accepted < ex.num_verified}")
    _events(ex)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    specs=st.lists(requests, min_size=1, max_size=8),
)
def test_small_cache_gives_same_tokens_as_big_cache(config: dict, specs: list) -> None:
    """Preemption, recompute, prefix hits and copy-on-write never change what is generated; nor does async
    scheduling (the small cache runs overlapped, the big one step by step)."""
    results = []
    for kv_tokens, overlap in ((config["kv_tokens"], False), (1000, False), (config["kv_tokens"], True)):
        cfg = _sized(dict(config, kv_tokens=kv_tokens, max_waiting=100))
        engine, ex = make_engine(dynamic_batch_window_s=0.0, async_scheduling=overlap, **cfg)
        accepted = set()
        for i, spec in enumerate(specs):
            r = build(i, spec)
            if spec["eos_at"] is not None:
                ex.eos_after[r.req_id] = spec["eos_at"]
            try:
                engine.add_request(r)
                accepted.add(r.req_id)
            except RequestRejectedError:
                pass
        col = run(engine, max_steps=5000, driver=Overlapped(engine) if overlap else None)
        _events(ex)
        results.append((accepted, col.tokens, col.reasons))
    small, big, overlapped = results
    assert small[0] <= big[0] and overlapped[0] == small[0]
    for key, toks in small[1].items():
        assert big[1][key] == toks, key
        assert big[2][key] == small[2][key]
    assert overlapped[1] == small[1] and overlapped[2] == small[2]


def _events(ex: object) -> None:
    calls = ex.calls  # type: ignore[attr-defined]
    event(f"preempted: {any(c.preempted_req_ids for c in calls)}")
    event(f"copy-on-write: {any(c.block_copies for c in calls)}")
    event(f"prefix hit: {any(n.num_computed_tokens for c in calls for n in c.scheduled_new_reqs)}")


def _random_workload(rng: random.Random, num: int) -> list[dict]:
    out = []
    for _ in range(num):
        out.append(
            {
                "prefix": rng.randrange(len(PREFIXES)),
                "tail": [rng.randrange(400) for _ in range(rng.randint(1, 8))],
                "max_tokens": rng.randint(1, 12),
                "n": rng.choice([1, 1, 2, 3]),
                "extra_best_of": rng.choice([0, 0, 1]),
                "priority": rng.randrange(3),
                "salt": rng.choice([None, None, "s"]),
                "min_tokens": rng.randrange(3),
                "eos_at": rng.choice([None, None, rng.randint(1, 6)]),
                "beam": rng.randrange(5),
            }
        )
    return out


@pytest.mark.parametrize("seed", range(40))
def test_seeded_stress_under_memory_pressure(seed: int) -> None:
    """Many requests on a tiny cache (37 of these 40 seeds preempt), with random aborts mid-way; the
    survivors' tokens match an unconstrained run."""
    rng = random.Random(seed)
    config = {
        "block_size": rng.choice([1, 2, 4]),
        "max_batched": rng.randint(8, 40),
        "max_seqs": rng.randint(2, 8),
        "policy": rng.choice(["continuous", "continuous", "prefill_first", "static", "dynamic"]),
        "ordering": rng.choice(["fcfs", "priority"]),
        "caching": rng.random() < 0.7,
        "max_model_len": 32,
        "max_waiting": 100,
    }
    specs = _random_workload(rng, rng.randint(6, 16))
    abort_ids = {f"r{i}" for i in range(len(specs)) if rng.random() < 0.2}
    abort_step = rng.randint(1, 10)
    results = []
    rejected: set[str] = set()  # beam searches whose worst case cannot fit the tiny cache
    for kv_tokens in (32, 2000):
        engine, ex = make_engine(dynamic_batch_window_s=0.0, **_sized(dict(config, kv_tokens=kv_tokens)))
        for i, spec in enumerate(specs):
            r = build(i, spec)
            if spec["eos_at"] is not None:
                ex.eos_after[r.req_id] = spec["eos_at"]
            if kv_tokens == 2000:
                engine.add_request(r)  # the big cache takes everything
                continue
            try:
                engine.add_request(r)
            except RequestRejectedError:
                assert r.sampling_params.use_beam_search, r.req_id
                rejected.add(r.req_id)
        col = Collected()
        for step in range(5000):
            if not engine.has_unfinished_requests():
                break
            if step == abort_step:
                for req_id in sorted(abort_ids):
                    engine.abort_request(req_id)
            collect(engine.step(), col)
            engine.check_integrity()
        results.append(col)
        assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    small, big = results
    for key, toks in small.tokens.items():
        if key[0] in abort_ids:
            continue
        assert key[0] not in rejected
        assert big.tokens[key] == toks and big.reasons[key] == small.reasons[key], key
