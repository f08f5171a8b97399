"""The KV tiers' counters (scheduler/kv/offload.py's ``OffloadStats``, totals) as the engine's metrics export them:
increments, by tier and by direction, with Ray's metric classes replaced by recorders (metric_recorders.py)."""

from __future__ import annotations

import pytest
from metric_recorders import _values, recorded

from cbserve.cluster.ops import metrics as cm
from cbserve.scheduler.kv.offload import OffloadStats


@pytest.fixture()
def log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, dict[str, str]]]:
    return recorded(monkeypatch)


def test_engine_metrics_export_the_kv_tiers_counters_as_increments(log: list) -> None:
    em = cm.EngineMetrics("m", "0")
    assert {t["medium"] for n, _, t in log if n == "cbserve_kv_tier_hit_tokens"} == {"ram", "disk", "remote"}
    log.clear()
    stats = OffloadStats(hit_tokens_ram=64, hit_tokens_disk=16, hit_tokens_remote=8, bytes_stored=100, bytes_loaded=50,
                         evictions_ram=2, prefetch_failures=1, load_s=0.5, bytes_pulled=40, pull_s=0.25,
                         bytes_pulled_ray=24, pull_failures=3)  # fmt: skip
    em.observe_tiers(stats)
    stats.hit_tokens_ram, stats.bytes_loaded = 96, 80  # 32 more from RAM, none from disk
    em.observe_tiers(stats)
    hits = [(v, t["medium"]) for n, v, t in log if n == "cbserve_kv_tier_hit_tokens"]
    # a disk hit is counted as disk, a pulled one (prefill/decode disaggregation) as remote, neither as ram
    assert hits == [(40.0, "ram"), (16.0, "disk"), (8.0, "remote"), (32.0, "ram")]
    moved = [(v, t["direction"]) for n, v, t in log if n == "cbserve_kv_tier_bytes"]
    assert moved == [(100.0, "stored"), (50.0, "loaded"), (40.0, "pulled"), (24.0, "pulled_ray"), (30.0, "loaded")]
    assert _values(log, "kv_tier_evictions") == [2.0] and _values(log, "kv_tier_prefetch_failures") == [1.0]
    assert _values(log, "kv_tier_transfer_seconds") == [0.5, 0.25] and _values(log, "kv_tier_pull_failures") == [3.0]


def test_the_pools_evictions_by_reason_and_the_blocks_hints_keep(log: list) -> None:
    from cbserve.scheduler.stats import SchedulerStats

    em = cm.EngineMetrics("m", "0")
    log.clear()
    em.observe_idle(SchedulerStats(num_retained_kv_blocks=5, kv_evictions=7, kv_hint_evictions=2))
    em.observe_idle(SchedulerStats(num_retained_kv_blocks=3, kv_evictions=10, kv_hint_evictions=2))
    evicted = [(v, t["reason"]) for n, v, t in log if n == "cbserve_kv_cache_evictions"]
    assert evicted == [(5.0, "lru"), (2.0, "retention_overridden"), (3.0, "lru")]
    assert _values(log, "kv_cache_retained_blocks") == [5.0, 3.0]
