"""What cbserve exports to Prometheus, as data: every metric's name, kind, labels, buckets and the label values its
series start with (``MetricSpec``); ``exported_names()``, the series Prometheus stores. metrics.py makes the Ray
metrics from them and feeds them; dashboards/generate.py and the tests read them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from typing import Literal

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
PD_DECISIONS = ("remote", "local_short", "local_busy", "local_failed", "local_unfit")  # ingress/disaggregation.py
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
    # the pool's evictions and the blocks retention hints keep (scheduler/kv/retention.py)
    _c("kv_cache_evictions", "Cached blocks the KV pool evicted: least recently freed (lru), or kept by a retention "
       "hint that had to give way (retention_overridden: nothing else was free).", (*ENGINE_LABELS, "reason"),
       _each("reason", ("lru", "retention_overridden"))),
    _g("kv_cache_retained_blocks", "Free cached blocks a retention hint keeps (evicted only once nothing else is "
       "free)."),
    # KV tiers below the pool (kv_offloading_size; 0 on an engine without them)
    _c("kv_tier_hit_tokens", "Prompt tokens loaded from the KV tiers, by the tier they were found in (disk: "
       "prefetched from disk into RAM first; remote: pulled from the prefill engine that computed them).",
       (*ENGINE_LABELS, "medium"), _each("medium", ("ram", "disk", "remote"))),
    _c("kv_tier_bytes", "Bytes moved by the KV tiers: pool -> RAM (stored), RAM -> pool (loaded), disk -> RAM "
       "(from_disk), a prefill engine's shared tier -> RAM (pulled; pulled_ray: of those, through the Ray object "
       "store: from another node, or every pull with transport ray).", (*ENGINE_LABELS, "direction"),
       _each("direction", ("stored", "loaded", "from_disk", "pulled", "pulled_ray"))),
    _c("kv_tier_transfer_seconds", "Time spent moving KV blocks: pool <-> RAM tier (store, load: the worker's), and "
       "pulls from a prefill engine (pull: from the step that asked to the blocks in the RAM tier).",
       (*ENGINE_LABELS, "direction"), _each("direction", ("store", "load", "pull"))),
    _c("kv_tier_pull_failures", "Blocks a decode engine could not pull from its prefill engine (gone, overwritten, "
       "not published in time): computed instead."),
    _c("kv_tier_evictions", "Blocks evicted from a KV tier (least recently used).", (*ENGINE_LABELS, "medium"),
       _each("medium", ("ram", "disk"))),
    _c("kv_tier_prefetch_failures", "Disk blocks that failed their checks or were missing (recomputed)."),
    # per-iteration histograms
    _h("iteration_tokens", "Tokens scheduled per iteration (prefill + decode).", TOKEN_COUNT_BUCKETS),
    _h("iteration_batch_size", "Sequences scheduled per iteration.", BATCH_SIZE_BUCKETS),
    _h("engine_step_seconds", "Wall time of one engine step (schedule + execute + update).",
       STEP_LATENCY_BUCKETS),
    _h("scheduler_time_seconds", "Scheduler bookkeeping per step (schedule + update_from_output).",
       STEP_LATENCY_BUCKETS),
    _h("dispatch_overhead_seconds", "Step dispatch overhead (execute time minus the rank's forward).",
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
    _c("pd_prefills", "A P:D app's requests by where their prompt was prefilled (cluster/ingress/disaggregation.py): "
       "on a prefill replica (remote) or on the decode replica (short uncached prompt, prefill replicas busy, the "
       "prefill leg failed, or a request that does not qualify).", ("model", "decision"),
       _each("decision", PD_DECISIONS)),
)  # fmt: skip
_LORA_SPECS = tuple(s for s in ENGINE_SPECS if s.name.startswith(PREFIX + "lora_"))
ALL_SPECS: tuple[MetricSpec, ...] = ENGINE_SPECS + WORKER_SPECS + INGRESS_SPECS


def exported_names() -> set[str]:
    """Every series name (histogram suffixes included) Prometheus stores for our metrics."""
    return {s for spec in ALL_SPECS for s in spec.exported_series()}
