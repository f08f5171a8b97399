"""Prometheus metrics of every cbserve component, exported through Ray's metrics API.

The scheduler and the workers only fill stats dataclasses (scheduler/stats.py); this module alone turns
them into series, made with ``ray.util.metrics``: they leave through Ray's per-node metrics port, found by
Prometheus through Ray's service-discovery file (deploy/prometheus.yml), beside Serve's ``ray_serve_*``.

Ray's exporter prefixes every metric with ``ray_`` (series ``ray_cbserve_*``: ``exported_names()``,
dashboards/README.md) and adds its own labels (``Component``, ``NodeAddress``, ``WorkerId``, ...).

Labels are bounded: ``model``, ``replica``, ``rank`` (workers), ``reason`` (finish, reject), ``route`` and
``status`` (HTTP; routes outside ``KNOWN_ROUTES`` are ``other``), ``decision`` (the router), ``lora_name`` and
vLLM's ``lora_requests_info`` labels (the running adapters, at most ``max_loras``, and the waiting ones).

No "No data" on a healthy cluster: every counter and gauge is created at 0 when its component starts, for
each of its known label values (``MetricSpec.initial``: every finish and reject reason, the HTTP statuses of
the generation routes), so a dashboard's rate() reads 0 before the first event. A histogram has no series
until its first observation (Ray cannot export an empty one); the first request creates them. Ray drops a gauge
not set for a while, so gauges are set again on every step (or refresh) even when idle.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from typing import Any, Literal

RAY_EXPORT_PREFIX = "ray_"  # what Ray's exporter puts in front of every custom metric name
PREFIX = "cbserve_"  # of all our metric names (as registered with ray.util.metrics)

Kind = Literal["counter", "gauge", "histogram"]

# --- buckets: LLM latencies from milliseconds to minutes -----------------------------------------
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
    5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
STEP_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)  # fmt: skip
TOKEN_COUNT_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(18))  # 1 .. 131072
BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(12))  # 1 .. 2048

ENGINE_LABELS = ("model", "replica")
FINISH_REASONS = ("stop", "length", "abort", "error")
# what decided a request's replica (ingress/router.py): a prefix-cache hit, prefix (or adapter) affinity, load alone,
# or its turn
ROUTING_DECISIONS = ("cache_hit", "affinity", "least_loaded", "round_robin")
# what SchedulerActor passes to EngineMetrics.observe_rejected (QueueFullError, RequestRejectedError)
REJECT_REASONS = ("queue_full", "rejected")
WORKER_LABELS = ("model", "replica", "rank")
KNOWN_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/health",
                          "/stats", "/tokenize", "/detokenize", "/version"})
# speculative decoding: accepted drafts by position ("position" label), bounded; later positions share the last
SPEC_POSITIONS = tuple(str(j) for j in range(15)) + ("15+",)
# The routes that generate, and the statuses they answer (OpenAI error statuses): created at 0 at start-up.
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
HTTP_STATUSES = ("200", "400", "401", "404", "429", "500", "503")

Labels = Mapping[str, str]
NO_LABELS: tuple[Labels, ...] = ({},)  # one series, labelled by the component's default tags only


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as registered (without Ray's export prefix)
    kind: Kind
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    # label values (beyond the component's default tags) of the series created at 0 at start-up
    initial: tuple[Labels, ...] = ()

    @property
    def exported(self) -> str:
        """The base name of the series Prometheus stores (counters get ``_total``)."""
        base = RAY_EXPORT_PREFIX + self.name
        return base + "_total" if self.kind == "counter" else base

    def exported_series(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return tuple(self.exported + s for s in ("_bucket", "_sum", "_count"))
        return (self.exported,)


def _c(
    name: str, desc: str, labels: tuple[str, ...] = ENGINE_LABELS, initial: tuple[Labels, ...] = NO_LABELS
) -> MetricSpec:
    return MetricSpec(PREFIX + name, "counter", desc, labels, initial=initial)


def _g(name: str, desc: str, labels: tuple[str, ...] = ENGINE_LABELS) -> MetricSpec:
    return MetricSpec(PREFIX + name, "gauge", desc, labels, initial=NO_LABELS)


def _each(label: str, values: tuple[str, ...]) -> tuple[Labels, ...]:
    return tuple({label: v} for v in values)


def _h(
    name: str, desc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ENGINE_LABELS
) -> MetricSpec:
    return MetricSpec(PREFIX + name, "histogram", desc, labels, buckets)


REASON = (*ENGINE_LABELS, "reason")
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
NO_ADAPTER: tuple[Labels, ...] = ({"lora_name": ""},)  # the 0 series of an engine before (or without) adapters
ENGINE_SPECS: tuple[MetricSpec, ...] = (
    # scheduler state (gauges)
    _g("num_requests_running", "Requests in the running set (being prefilled or decoded)."),
    _g("num_requests_waiting", "Requests waiting to be scheduled (including preempted ones)."),
    _g("num_requests_preempted", "Waiting requests that were preempted and await recompute."),
    _g("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1)."),
    _g("kv_cache_blocks", "Total number of KV-cache blocks."),
    _g("kv_cache_free_blocks", "Free KV-cache blocks."),
    # counters
    _c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    _c("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    _c("num_preemptions", "Preemptions (running requests sent back to the waiting queue)."),
    _c("prompt_tokens", "Prompt tokens of requests that got their first token (prefill done)."),
    _c("generation_tokens", "Generated tokens."),
    _c("embedding_requests", "Requests of a pooling engine (runner: pooling) that got their embedding."),
    _c("iteration_prefill_tokens", "Prefill tokens computed by the engine (chunks included)."),
    _c("iteration_decode_tokens", "Decode tokens computed by the engine."),
    _c("request_finished", "Finished requests by finish reason.", REASON, _each("reason", FINISH_REASONS)),
    _c("request_rejected", "Requests rejected at admission by reason.", REASON, _each("reason", REJECT_REASONS)),
    # speculative decoding (0 on an engine without speculative_config)
    _c("spec_decode_num_drafts", "Speculative decoding: sequence-steps that verified drafts."),
    _c("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed."),
    _c("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
    _c("spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: accepted drafts by position in the draft.",
       (*ENGINE_LABELS, "position"), _each("position", SPEC_POSITIONS[:4])),
    # LoRA (engines with enable_lora); vLLM's lora_requests_info: the value is the time the set was seen
    MetricSpec(PREFIX + "lora_requests_info", "gauge", "Running and waiting LoRA adapters (comma-separated) and "
               "max_lora; the value is the Unix time they were seen.", (*ENGINE_LABELS, *LORA_INFO_LABELS),
               initial=({"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""},)),
    MetricSpec(PREFIX + "lora_num_requests_running", "gauge", "Running requests by LoRA adapter.",
               (*ENGINE_LABELS, "lora_name"), initial=NO_ADAPTER),
    MetricSpec(PREFIX + "lora_num_requests_waiting", "gauge", "Waiting requests by LoRA adapter.",
               (*ENGINE_LABELS, "lora_name"), initial=NO_ADAPTER),
    # per-iteration histograms
    _h("iteration_tokens", "Tokens scheduled per iteration (prefill + decode).", TOKEN_COUNT_BUCKETS),
    _h("iteration_batch_size", "Sequences scheduled per iteration.", BATCH_SIZE_BUCKETS),
    _h("engine_step_seconds", "Wall time of one engine step (schedule + execute + update).",
       STEP_LATENCY_BUCKETS),
    _h("scheduler_time_seconds", "Scheduler bookkeeping per step (schedule + update_from_output).",
       STEP_LATENCY_BUCKETS),
    _h("dispatch_overhead_seconds", "Ray dispatch overhead per step (execute time minus worker forward).",
       STEP_LATENCY_BUCKETS),
    # per-request histograms
    _h("time_to_first_token_seconds", "Time to first token (from arrival).", REQUEST_LATENCY_BUCKETS),
    _h("inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS),
    _h("time_per_output_token_seconds", "Mean time per output token after the first, per request.",
       TOKEN_LATENCY_BUCKETS),
    _h("e2e_request_latency_seconds", "End-to-end latency (arrival to finish).", REQUEST_LATENCY_BUCKETS),
    _h("request_queue_time_seconds", "Time from arrival to first scheduled.", REQUEST_LATENCY_BUCKETS),
    _h("request_prefill_time_seconds", "Time from first scheduled to first token.", REQUEST_LATENCY_BUCKETS),
    _h("request_decode_time_seconds", "Time from first token to last token.", REQUEST_LATENCY_BUCKETS),
    _h("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_COUNT_BUCKETS),
    _h("request_generation_tokens", "Generated tokens of finished requests.", TOKEN_COUNT_BUCKETS),
)  # fmt: skip
WORKER_SPECS: tuple[MetricSpec, ...] = (
    _h("worker_forward_seconds", "Worker forward pass + sampling per iteration.", STEP_LATENCY_BUCKETS,
       WORKER_LABELS),
    _c("lora_adapter_loads", "LoRA adapters read into the worker's cache (enable_lora).", WORKER_LABELS),
    _c("lora_adapter_evictions", "LoRA adapters dropped from the worker's cache past max_cpu_loras.", WORKER_LABELS),
)  # fmt: skip
INGRESS_SPECS: tuple[MetricSpec, ...] = (
    _c("http_requests", "HTTP requests by route and status.", ("model", "route", "status"),
       tuple({"route": r, "status": s} for r, s in product(GENERATION_ROUTES, HTTP_STATUSES))),
    _h("http_request_duration_seconds", "HTTP request latency (to the last byte of the response).",
       REQUEST_LATENCY_BUCKETS, ("model", "route")),
    _g("http_requests_in_flight", "HTTP requests being served by this ingress replica.", ("model",)),
    _c("routing_decisions", "Requests routed to an engine replica, by what decided it (cluster/ingress/router.py).",
       ("model", "decision"), _each("decision", ROUTING_DECISIONS)),
    _h("routing_matched_prefix_tokens", "Cache-aware routing: prompt tokens the chosen replica's prefix cache "
       "held (0: no hit).", TOKEN_COUNT_BUCKETS, ("model",)),
)  # fmt: skip
_LORA_SPECS = tuple(s for s in ENGINE_SPECS if s.name.startswith(PREFIX + "lora_"))
ALL_SPECS: tuple[MetricSpec, ...] = ENGINE_SPECS + WORKER_SPECS + INGRESS_SPECS


def exported_names() -> set[str]:
    """Every series name (histogram suffixes included) Prometheus stores for our metrics."""
    return {s for spec in ALL_SPECS for s in spec.exported_series()}


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

    def observe_step(self, result: Any, dispatch_overhead_s: float) -> None:
        """``result`` is a scheduler StepResult (scheduler_stats, iteration_stats, outputs)."""
        self._observe_scheduler(result.scheduler_stats, dispatch_overhead_s)
        self._observe_iteration(result.iteration_stats)

    def observe_idle(self, scheduler_stats: Any) -> None:
        """Refresh the state gauges while no step runs (Ray stops exporting a gauge not set for a while)."""
        self._observe_scheduler(scheduler_stats, 0.0)

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
        self._in_flight = 0

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        route = route if route in KNOWN_ROUTES else "other"
        self._m.inc("http_requests", 1, {"route": route, "status": str(int(status))})
        self._m._m["http_request_duration_seconds"].observe(max(0.0, float(seconds)), tags={"route": route})

    def in_flight(self, delta: int) -> None:
        self._in_flight = max(0, self._in_flight + int(delta))
        self._m.set("http_requests_in_flight", self._in_flight)

    def refresh(self) -> None:
        """Re-set the gauge while idle (Ray stops exporting a gauge that is not set for a while)."""
        self._m.set("http_requests_in_flight", self._in_flight)

    def observe_routing(self, stats: Any) -> None:
        """``stats``: the router's RoutingStats since the last call (decisions by kind, matched prefix lengths)."""
        for kind, count in stats.decisions.items():
            self._m.inc("routing_decisions", count, {"decision": kind})
        for tokens, count in stats.matched_tokens.items():
            for _ in range(count):
                self._m.observe("routing_matched_prefix_tokens", tokens)


def _reason(reason: str | None) -> str:
    """Bounded finish / reject reason label (free text would make the label unbounded)."""
    text = (reason or "unknown").strip().lower()
    return text if text.replace("_", "").isalnum() and len(text) <= 32 else "other"
