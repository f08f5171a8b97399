"""Prometheus metrics of every cbserve component, exported through Ray's metrics API.

The scheduler and the workers only fill stats dataclasses (scheduler/stats.py); this module alone turns
them into series, made with ``ray.util.metrics``: they leave through Ray's per-node metrics port, found by
Prometheus through Ray's service-discovery file (deploy/prometheus.yml), beside Serve's ``ray_serve_*``.

Ray's exporter prefixes every metric with ``ray_`` (series ``ray_cbserve_*``: ``exported_names()``,
dashboards/README.md) and adds its own labels (``Component``, ``NodeAddress``, ``WorkerId``, ...).

Labels are bounded: ``model``, ``replica``, ``rank`` (workers), ``reason`` (finish, reject), ``route`` and
``status`` (HTTP; routes outside ``KNOWN_ROUTES`` are ``other``), ``decision`` (the router), ``medium`` and
``direction`` (the KV tiers), ``lora_name`` and vLLM's ``lora_requests_info`` labels (the running adapters, at
most ``max_loras``, and the waiting ones).

No "No data" on a healthy cluster: every counter and gauge is created at 0 when its component starts, for
each of its known label values (``MetricSpec.initial``: every finish and reject reason, the HTTP statuses of
the generation routes), so a dashboard's rate() reads 0 before the first event. A histogram has no series
until its first observation (Ray cannot export an empty one); the first request creates them. Ray drops a gauge
not set for a while, so gauges are set again on every step (or refresh) even when idle.
"""

from __future__ import annotations

import time
from typing import Any

from cbserve.cluster.ops.metric_specs import (
    _LORA_SPECS,
    ENGINE_SPECS,
    INGRESS_SPECS,
    KNOWN_ROUTES,
    NO_ADAPTER,
    PREFIX,
    SPEC_POSITIONS,
    WORKER_SPECS,
    MetricSpec,
)


def _counter_type() -> type:
    from ray.util.metrics import Counter

    return Counter


def _make(spec: MetricSpec) -> Any:
    from ray.util import metrics as rm

    if spec.kind == "counter":
        return rm.Counter(spec.name, spec.description, tag_keys=spec.labels)
    if spec.kind == "gauge":
        return rm.Gauge(spec.name, spec.description, tag_keys=spec.labels)
    return rm.Histogram(spec.name, spec.description, boundaries=list(spec.buckets), tag_keys=spec.labels)


class _Metrics:
    """Ray metric objects for a tuple of specs, keyed by the spec name without prefix. Each spec's
    ``initial`` series are created at 0 here, so they are exported before the first event."""

    def __init__(self, specs: tuple[MetricSpec, ...], default_tags: dict[str, str]) -> None:
        self._m: dict[str, Any] = {}
        for spec in specs:
            metric = _make(spec)
            metric.set_default_tags({k: v for k, v in default_tags.items() if k in spec.labels})
            name = spec.name.removeprefix(PREFIX)
            self._m[name] = metric
            for labels in spec.initial:
                self.zero(name, dict(labels) or None)

    def inc(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        if value > 0:  # Ray counters refuse 0
            self._m[name].inc(float(value), tags=tags)

    def set(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        self._m[name].set(float(value), tags=tags)

    def zero(self, name: str, tags: dict[str, str] | None = None) -> None:
        """Create the series at 0, so that rate() reads 0 (not "no data") before the first event."""
        metric = self._m[name]
        if isinstance(metric, _counter_type()):
            metric._record(0.0, tags)  # Counter.inc() refuses 0; _record is what inc() calls
        else:
            metric.set(0.0, tags=tags)

    def observe(self, name: str, value: float | None) -> None:
        if value is not None and value >= 0:
            self._m[name].observe(float(value))


class EngineMetrics:
    """Metrics of one engine replica, fed by the SchedulerActor after every step()."""

    def __init__(self, model: str, replica: str) -> None:
        self._m = _Metrics(ENGINE_SPECS, {"model": model, "replica": str(replica)})
        self._adapters: set[str] = set()  # adapters with requests at the last observation
        self._tiers: dict[str, float] = {}  # the KV tiers' totals at the last observation
        self._evicted = (0, 0)  # the pool's evictions at the last observation: with a live hint, without

    def observe_step(self, result: Any, dispatch_overhead_s: float) -> None:
        """``result`` is a scheduler StepResult (scheduler_stats, iteration_stats, outputs)."""
        self._observe_scheduler(result.scheduler_stats, dispatch_overhead_s)
        self._observe_iteration(result.iteration_stats)

    def observe_idle(self, scheduler_stats: Any) -> None:
        """Refresh the state gauges while no step runs (Ray stops exporting a gauge not set for a while)."""
        self._observe_scheduler(scheduler_stats, 0.0)

    def observe_tiers(self, stats: Any) -> None:
        """The KV tiers' counters (scheduler/kv/offload.py's ``OffloadStats``, totals): exported as increments."""
        last, self._tiers = self._tiers, dict(vars(stats))
        d = {k: _delta(v, last.get(k, 0)) for k, v in self._tiers.items()}
        m = self._m
        m.inc("kv_tier_hit_tokens", d["hit_tokens_ram"] - d["hit_tokens_disk"] - d["hit_tokens_remote"],
              {"medium": "ram"})
        m.inc("kv_tier_hit_tokens", d["hit_tokens_disk"], {"medium": "disk"})
        m.inc("kv_tier_hit_tokens", d["hit_tokens_remote"], {"medium": "remote"})
        for direction in ("stored", "loaded", "from_disk", "pulled", "pulled_ray"):
            m.inc("kv_tier_bytes", d[f"bytes_{direction}"], {"direction": direction})
        m.inc("kv_tier_transfer_seconds", d["store_s"], {"direction": "store"})
        m.inc("kv_tier_transfer_seconds", d["load_s"], {"direction": "load"})
        m.inc("kv_tier_transfer_seconds", d["pull_s"], {"direction": "pull"})
        m.inc("kv_tier_pull_failures", d["pull_failures"])
        m.inc("kv_tier_evictions", d["evictions_ram"], {"medium": "ram"})
        m.inc("kv_tier_evictions", d["evictions_disk"], {"medium": "disk"})
        m.inc("kv_tier_prefetch_failures", d["prefetch_failures"])

    def observe_failed(self, num_requests: int) -> None:
        """Requests lost with their worker group (they end with an error, not a normal finish)."""
        self._m.inc("request_finished", num_requests, {"reason": "error"})

    def observe_rejected(self, reason: str) -> None:
        """Count one request refused by add_request(). The caller that catches the exception counts it
        (``iteration_stats.rejected_reasons`` holds free-text messages and is not counted again)."""
        self._m.inc("request_rejected", 1, {"reason": _reason(reason)})

    def _observe_scheduler(self, s: Any, dispatch_overhead_s: float) -> None:
        m = self._m
        m.set("num_requests_running", s.num_running)
        m.set("num_requests_waiting", s.num_waiting)
        m.set("num_requests_preempted", s.num_preempted_waiting)
        m.set("kv_cache_usage_ratio", s.kv_cache_usage)
        m.set("kv_cache_blocks", s.num_kv_blocks)
        m.set("kv_cache_free_blocks", s.num_free_kv_blocks)
        m.set("kv_cache_retained_blocks", s.num_retained_kv_blocks)
        now = (s.kv_hint_evictions, s.kv_evictions - s.kv_hint_evictions)
        hinted, lru = (_delta(total, last) for total, last in zip(now, self._evicted, strict=True))
        m.inc("kv_cache_evictions", lru, {"reason": "lru"})
        m.inc("kv_cache_evictions", hinted, {"reason": "retention_overridden"})
        self._evicted = now
        m.inc("prefix_cache_queries", s.prefix_cache_queries)
        m.inc("prefix_cache_hits", s.prefix_cache_hits)
        m.inc("num_preemptions", s.num_preemptions)
        m.inc("iteration_prefill_tokens", s.num_prefill_tokens)
        m.inc("iteration_decode_tokens", s.num_decode_tokens)
        if s.spec_decode is not None:
            self._observe_spec(s.spec_decode)
        if s.lora is not None:
            self._observe_lora(s.lora)
        else:
            self._observe_no_lora()
        num_tokens = s.num_prefill_tokens + s.num_decode_tokens
        if s.batch_size > 0 or num_tokens > 0:  # idle polls would drown the step histograms
            m.observe("iteration_tokens", num_tokens)
            m.observe("iteration_batch_size", s.batch_size)
            m.observe("engine_step_seconds", s.schedule_time_s + s.execute_time_s)
            m.observe("scheduler_time_seconds", s.schedule_time_s)
            m.observe("dispatch_overhead_seconds", max(0.0, dispatch_overhead_s))

    def _observe_spec(self, spec: Any) -> None:
        """``spec``: a scheduler SpecDecodeStats (drafts verified in one step)."""
        m = self._m
        m.inc("spec_decode_num_drafts", spec.num_drafts)
        m.inc("spec_decode_num_draft_tokens", spec.num_draft_tokens)
        m.inc("spec_decode_num_accepted_tokens", spec.num_accepted_tokens)
        last = len(SPEC_POSITIONS) - 1
        for j, count in enumerate(spec.accepted_per_pos):
            m.inc("spec_decode_num_accepted_tokens_per_pos", count, {"position": SPEC_POSITIONS[min(j, last)]})

    def _observe_no_lora(self) -> None:
        """An engine without LoRA: its 0 series, set again every step (Ray drops a gauge left unset)."""
        for spec, labels in ((sp, lab) for sp in _LORA_SPECS for lab in sp.initial):
            self._m.set(spec.name.removeprefix(PREFIX), 0, dict(labels))

    def _observe_lora(self, lora: Any) -> None:
        """``lora``: a scheduler LoRAStats. An adapter whose requests are gone is set to 0 once."""
        m = self._m
        names = set(lora.running) | set(lora.waiting)
        for name in sorted(names | self._adapters):
            m.set("lora_num_requests_running", lora.running.get(name, 0), {"lora_name": name})
            m.set("lora_num_requests_waiting", lora.waiting.get(name, 0), {"lora_name": name})
        self._adapters = names
        if not names:  # Ray drops a gauge not set for a while: the 0 series stays by being set again
            for name in ("lora_num_requests_running", "lora_num_requests_waiting"):
                m.set(name, 0, dict(NO_ADAPTER[0]))
        info = {"max_lora": str(lora.max_loras), "running_lora_adapters": ",".join(sorted(lora.running)),
                "waiting_lora_adapters": ",".join(sorted(lora.waiting))}  # fmt: skip
        m.set("lora_requests_info", time.time(), info)

    def _observe_iteration(self, it: Any) -> None:
        m = self._m
        m.inc("prompt_tokens", it.num_prompt_tokens)
        m.inc("generation_tokens", it.num_generation_tokens)
        m.inc("embedding_requests", it.num_embedding_requests)
        for ttft in it.ttfts:
            m.observe("time_to_first_token_seconds", ttft)
        for itl in it.inter_token_latencies:
            m.observe("inter_token_latency_seconds", itl)
        for fin in it.finished:
            t = fin.times
            m.inc("request_finished", 1, {"reason": _reason(fin.finish_reason)})
            m.observe("e2e_request_latency_seconds", t.e2e)
            m.observe("request_queue_time_seconds", t.queue_time)
            m.observe("request_prefill_time_seconds", t.prefill_time)
            m.observe("request_decode_time_seconds", t.decode_time)
            m.observe("time_per_output_token_seconds", t.tpot)
            m.observe("request_prompt_tokens", t.num_prompt_tokens)
            m.observe("request_generation_tokens", t.num_generation_tokens)


class WorkerMetrics:
    """Metrics of one tensor-parallel rank of one engine replica."""

    def __init__(self, model: str, replica: str, rank: int) -> None:
        self._m = _Metrics(WORKER_SPECS, {"model": model, "replica": str(replica), "rank": str(rank)})
        self._lora = (0, 0)  # the worker's adapter loads and evictions so far

    def observe_forward(self, seconds: float, lora_loads: int = 0, lora_evictions: int = 0) -> None:
        """One step; ``lora_*``: the worker's running totals (``LoRAManager``), exported as counter increments."""
        self._m.observe("worker_forward_seconds", seconds)
        self._m.inc("lora_adapter_loads", lora_loads - self._lora[0])
        self._m.inc("lora_adapter_evictions", lora_evictions - self._lora[1])
        self._lora = (lora_loads, lora_evictions)


class IngressMetrics:
    """HTTP metrics of one ingress replica. ``route`` must be a route template, never a raw path."""

    def __init__(self, model: str) -> None:
        self._m = _Metrics(INGRESS_SPECS, {"model": model})

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        route = route if route in KNOWN_ROUTES else "other"
        self._m.inc("http_requests", 1, {"route": route, "status": str(int(status))})
        self._m._m["http_request_duration_seconds"].observe(max(0.0, float(seconds)), tags={"route": route})

    def refresh(self, in_flight: int) -> None:
        """The HTTP requests in flight, set every tick from the HTTP edge's count (the replica's one count of them;
        set again while idle too: Ray stops exporting a gauge that is not set for a while)."""
        self._m.set("http_requests_in_flight", max(0, int(in_flight)))

    def observe_routing(self, stats: Any) -> None:
        """``stats``: the router's RoutingStats since the last call (decisions by kind, matched prefix lengths)."""
        for kind, count in stats.decisions.items():
            self._m.inc("routing_decisions", count, {"decision": kind})
        for where, count in stats.disaggregation.items():
            self._m.inc("pd_prefills", count, {"decision": where})
        for tokens, count in stats.matched_tokens.items():
            for _ in range(count):
                self._m.observe("routing_matched_prefix_tokens", tokens)


def _reason(reason: str | None) -> str:
    """Bounded finish / reject reason label (free text would make the label unbounded)."""
    text = (reason or "unknown").strip().lower()
    return text if text.replace("_", "").isalnum() and len(text) <= 32 else "other"


def _delta(total: float, last: float) -> float:
    """An engine's counter since the last observation; a rebuilt engine's counters start again from 0."""
    return total - last if total >= last else total
