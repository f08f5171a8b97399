"""LoRA in the Prometheus series (fast: no Ray): ``EngineMetrics`` turns the engine's ``LoRAStats`` (requests per
adapter, running and waiting: tests/scheduler/test_engine_stats.py) into per-adapter gauges (an adapter whose
requests are gone drops to 0) and vLLM's ``lora_requests_info``."""

from __future__ import annotations

from typing import Any

import pytest
import test_metrics

from cbserve.cluster.ops import metric_specs as ms
from cbserve.cluster.ops import metrics as cm
from cbserve.scheduler import LoRARequest
from cbserve.scheduler.stats import IterationStats, LoRAStats, SchedulerStats

log = test_metrics.log  # the fixture recording what would reach Ray's metrics
_values = test_metrics._values
SQL, CHAT = LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")


def _step(em: cm.EngineMetrics, lora: LoRAStats | None) -> None:
    stats = SchedulerStats(lora=lora)
    em.observe_step(type("R", (), {"scheduler_stats": stats, "iteration_stats": IterationStats()}), 0.0)


def _gauges(log: list, name: str) -> dict[str, float]:
    return {t["lora_name"]: v for n, v, t in log if n == ms.PREFIX + name}


def test_per_adapter_gauges_and_lora_requests_info(log: list, monkeypatch: pytest.MonkeyPatch) -> None:
    em = cm.EngineMetrics("m", "0")
    assert _gauges(log, "lora_num_requests_running") == {"": 0.0}  # created at 0, no adapter yet
    log.clear()
    monkeypatch.setattr(cm.time, "time", lambda: 1700000000.0)
    _step(em, LoRAStats(2, {"sql": 3, "chat": 1}, {"math": 2}))
    assert _gauges(log, "lora_num_requests_running") == {"chat": 1.0, "math": 0.0, "sql": 3.0}
    assert _gauges(log, "lora_num_requests_waiting") == {"chat": 0.0, "math": 2.0, "sql": 0.0}
    (info,) = [(v, t) for n, v, t in log if n == ms.PREFIX + "lora_requests_info"]
    assert info == (1700000000.0, {"model": "m", "replica": "0", "max_lora": "2", "running_lora_adapters": "chat,sql",
                                   "waiting_lora_adapters": "math"})  # fmt: skip
    log.clear()
    _step(em, LoRAStats(2, {"math": 1}, {}))  # sql and chat are done: set to 0 once...
    assert _gauges(log, "lora_num_requests_running") == {"chat": 0.0, "math": 1.0, "sql": 0.0}
    log.clear()
    _step(em, LoRAStats(2, {"math": 1}, {}))  # ...then left to expire
    assert _gauges(log, "lora_num_requests_running") == {"math": 1.0}
    log.clear()
    _step(em, LoRAStats(2, {}, {}))  # no adapter running: the 0 series set again (Ray drops a gauge left unset)
    assert _gauges(log, "lora_num_requests_running") == {"math": 0.0, "": 0.0}
    log.clear()
    _step(em, None)  # LoRA off: the 0 series and an info of max_lora 0, every step
    assert _gauges(log, "lora_num_requests_running") == {"": 0.0}
    assert _gauges(log, "lora_num_requests_waiting") == {"": 0.0}
    assert [t["max_lora"] for n, _, t in log if n == ms.PREFIX + "lora_requests_info"] == ["0"]


def test_lora_series_are_specified_with_their_labels() -> None:
    specs: dict[str, Any] = {s.name.removeprefix(ms.PREFIX): s for s in ms.ENGINE_SPECS}
    assert specs["lora_requests_info"].labels == ("model", "replica", "max_lora", "running_lora_adapters",
                                                  "waiting_lora_adapters")  # fmt: skip
    assert specs["lora_num_requests_waiting"].labels == ("model", "replica", "lora_name")


def test_worker_adapter_loads_and_evictions_become_counter_increments(log: list) -> None:
    wm = cm.WorkerMetrics("m", "0", 0)
    log.clear()
    wm.observe_forward(0.03)  # LoRA off: nothing counted
    wm.observe_forward(0.03, 2, 0)  # the worker's running totals (LoRAManager.num_loads, num_evictions)
    wm.observe_forward(0.03, 3, 1)
    wm.observe_forward(0.03, 3, 1)
    assert _values(log, "lora_adapter_loads") == [2.0, 1.0]
    assert _values(log, "lora_adapter_evictions") == [1.0]
