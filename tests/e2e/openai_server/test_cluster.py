"""Concurrency, cancellation and data parallelism on the 2-replica app."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from .cases import MAX_TOKENS
from .conftest import Server, wait_for

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def _routed(server: Server) -> dict[str, int]:
    return {k: v["routed_requests"] for k, v in server.main.stats().items()}


def _all_blocks_free(server: Server) -> bool:
    return all(
        r["num_in_flight"] == 0 and r["num_free_kv_blocks"] == r["num_kv_blocks"]
        for r in server.main.stats().values()
    )


def test_32_concurrent_streams_all_finish_on_both_replicas(server: Server) -> None:
    client = server.main.client()
    before = _routed(server)

    def one(i: int) -> tuple[str, str | None]:
        kw: dict[str, Any] = dict(model=server.main.model, max_tokens=8, temperature=0, stream=True)
        if i % 2:
            chunks = list(client.completions.create(prompt=f"Request {i}: a fact about the sea", **kw))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        msgs = [{"role": "user", "content": f"Say something about the number {i}."}]
        chunks = list(client.chat.completions.create(messages=msgs, **kw))
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert len(results) == 32
    assert all(reason in ("stop", "length") and text for text, reason in results), results
    after = _routed(server)
    assert all(after[k] > before[k] for k in after), (before, after)  # both replicas served traffic
    wait_for("engines idle", lambda: _all_blocks_free(server), 30)


def test_client_disconnect_aborts_and_frees_blocks(server: Server) -> None:
    client = server.main.client()
    stream = client.completions.create(
        model=server.main.model, prompt="Write a very long story about a dragon.", max_tokens=400,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    for _ in range(3):
        next(it)
    stats = server.main.stats().values()
    assert any(r["num_free_kv_blocks"] < r["num_kv_blocks"] for r in stats)  # its blocks are in use
    aborted = sum(r["num_aborted"] for r in stats)
    stream.close()  # the client goes away mid-generation
    t0 = time.monotonic()
    wait_for("the aborted request's blocks freed", lambda: _all_blocks_free(server), 20, 0.2)
    assert time.monotonic() - t0 < 10  # far sooner than the ~400 tokens left would take
    assert sum(r["num_aborted"] for r in server.main.stats().values()) == aborted + 1
    r = client.completions.create(model=server.main.model, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(server: Server) -> None:
    client = server.main.client()
    prefix = (
        "You are a helpful assistant who answers questions about geography, history and science with "
        "short, precise and friendly sentences, always citing one fact and never more than two. "
    ) * 2
    before = server.main.stats()
    for q in ("What is the capital of Italy?", "Name a river.", "What is a volcano?", "Who was Newton?"):
        client.completions.create(model=server.main.model, prompt=prefix + q, max_tokens=2, temperature=0)
    after = server.main.stats()
    routed = {k: after[k]["routed_requests"] - before[k]["routed_requests"] for k in after}
    assert sorted(routed.values()) == [0, 4], routed  # prefix affinity: all four on one replica
    target = next(k for k, v in routed.items() if v == 4)
    hits = after[target]["prefix_cache_hits"] - before[target]["prefix_cache_hits"]
    assert hits >= 3 * 64, hits  # requests 2..4 reuse the cached prefix blocks


def test_stats_report_each_workers_cpu_path(server: Server) -> None:
    """/stats names, per worker, the CPU ops it runs, the C kernels' ISA build and cpu_ops auto's probe."""
    from cbserve.worker.cpu.native import supported_levels

    for replica in server.main.stats().values():
        (cpu,) = replica["worker_cpu"]  # one rank
        probe = cpu["cpu_ops_probe"]
        assert probe is not None and probe["rows"] == [1, 128] and min(probe["native_ms"] + probe["torch_ms"]) > 0
        assert cpu["cpu_ops"] == ("native" if "native" in probe["paths"].values() else "onednn")
        assert set(cpu["cpu_linear_paths"].values()) <= {"native", "torch", "onednn"}
        if cpu["cpu_ops"] == "native":  # the CPU's best build, which reports its own ISA
            assert cpu["cpu_isa"] == supported_levels()[0]
            assert cpu["cpu_isa"] in cpu["cpu_isa_features"] or cpu["cpu_isa_features"] == []
        # the defaults ("auto"): the bundled model's Q4_1 rows rounded to int16 where the build has VNNI
        paths, vnni = cpu["cpu_linear_paths"], "i16_dot" in cpu["cpu_isa_features"]
        decode = "int16" if cpu["cpu_ops"] == "native" and vnni and paths["few_rows"] == "native" else "float32"
        prefill = "int16" if decode == "int16" and paths["many_rows"] == "native" else "float32"
        assert (cpu["cpu_decode_activations"], cpu["cpu_prefill_activations"]) == (decode, prefill)


def test_a_long_shared_prefix_goes_to_the_replica_that_cached_it(server: Server) -> None:
    """Cache-aware routing end to end: the engines' prefix-cache events reach the ingress's router on the output
    channel, and a request sharing a long prefix with an earlier one is sent where that prefix is cached."""
    client = server.main.client()
    prefix = ("Tenant 7. You are the support assistant of a small bicycle shop in Lyon: answer in one line, "
              "quote the part number when you name a part, and never promise a repair date. ") * 6  # fmt: skip
    before = server.main.stats()
    client.completions.create(model=server.main.model, prompt=prefix + "How do I fix a flat tyre?", max_tokens=2,
                              temperature=0)  # fmt: skip
    first = server.main.stats()
    (holder,) = [k for k in first if first[k]["routed_requests"] > before[k]["routed_requests"]]
    assert first[holder]["router_cached_blocks"] >= 200 // 16  # the router's picture of its cache
    client.completions.create(model=server.main.model, prompt=prefix + "Which chain fits a gravel bike?",
                              max_tokens=2, temperature=0)  # fmt: skip
    after = server.main.stats()
    routed = {k: after[k]["routed_requests"] - first[k]["routed_requests"] for k in after}
    assert routed[holder] == 1, routed
    assert after[holder]["routed_cache_hits"] == first[holder]["routed_cache_hits"] + 1  # decided by the cache
    assert after[holder]["prefix_cache_hits"] - first[holder]["prefix_cache_hits"] >= 200
