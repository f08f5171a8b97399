"""Router: least outstanding tokens, prefix affinity (rendezvous hashing), health (pure Python)."""

from __future__ import annotations

import pytest

from cbserve.cluster.router import NoHealthyReplicaError, Router


def _router(n: int = 3, imbalance: int = 100) -> Router:
    r = Router(n, block_size=4, affinity_tokens=8, max_imbalance_tokens=imbalance)
    for i in range(n):
        r.set_healthy(i, True)
    return r


def test_no_healthy_replica_raises() -> None:
    r = Router(2, block_size=4)
    with pytest.raises(NoHealthyReplicaError):
        r.choose([1, 2, 3])


def test_short_prompts_go_to_the_least_loaded() -> None:
    r = _router()
    r.add(0, 50)
    r.add(1, 10)
    r.add(2, 30)
    assert r.choose([1, 2, 3]) == 1  # shorter than a block: no affinity
    r.done(1, 10)
    r.add(1, 100)
    assert r.choose([1, 2]) == 2


def test_shared_prefix_sticks_to_one_replica_whatever_follows() -> None:
    r = _router()
    prefix = list(range(100, 108))
    targets = {r.choose(prefix + [i, i + 1, i + 2]) for i in range(20)}
    assert len(targets) == 1
    others = {r.choose(list(range(j, j + 8)) + [1]) for j in range(0, 400, 8)}
    assert len(others) == 3  # different prefixes spread over all replicas


def test_affinity_yields_to_load_past_the_imbalance() -> None:
    r = _router(imbalance=100)
    prompt = list(range(100, 112))
    pref = r.choose(prompt)
    r.add(pref, 101)
    assert r.choose(prompt) != pref  # 101 more tokens than the least loaded: go elsewhere
    r.done(pref, 101)
    assert r.choose(prompt) == pref


def test_unhealthy_replica_is_skipped_and_affinity_is_stable_for_the_rest() -> None:
    r = _router()
    prompts = [list(range(j, j + 8)) + [0] for j in range(0, 800, 8)]
    before = [r.choose(p) for p in prompts]
    r.set_healthy(1, False)
    after = [r.choose(p) for p in prompts]
    assert 1 not in after
    # rendezvous hashing: prompts that were not on the lost replica keep their replica
    assert all(a == b for a, b in zip(after, before, strict=True) if b != 1)


def test_bad_construction_is_rejected() -> None:
    with pytest.raises(ValueError):
        Router(0, block_size=16)
    with pytest.raises(ValueError):
        Router(2, block_size=16, adapter_memory=0)


def test_an_adapter_goes_where_it_was_served_within_the_imbalance_bound() -> None:
    r = Router(3, block_size=4, affinity_tokens=8, max_imbalance_tokens=100, adapter_memory=2)
    for i in range(3):
        r.set_healthy(i, True)
    prompts = [list(range(j, j + 12)) for j in range(0, 400, 12)]
    first = {r.choose(p, lora_id=7) for p in prompts}
    assert len(first) == 1  # unseen: its requests gather on one replica whatever their prefixes
    home = first.pop()
    r.add(home, 50, lora_id=7)
    assert {r.choose(p, lora_id=7) for p in prompts} == {home}  # now it holds the adapter
    r.add(home, 51)
    assert all(r.choose(p, lora_id=7) != home for p in prompts)  # 101 more tokens than the least loaded
    r.done(home, 51)
    other = (home + 1) % 3
    r.add(other, 0, lora_id=7)  # two replicas hold it: the less loaded one
    assert r.choose(prompts[0], lora_id=7) == other
    for lora in (8, 9):  # the replica forgets all but its last adapter_memory adapters
        r.add(other, 0, lora_id=lora)
    assert list(r.replicas[other].adapters) == [8, 9]
    assert r.choose(prompts[0], lora_id=7) == home
    base = [r.choose(p) for p in prompts]  # requests without an adapter: prefix affinity as before
    assert base == [r.preferred(r.prefix_key(p), [0, 1, 2]) for p in prompts]  # type: ignore[arg-type]
