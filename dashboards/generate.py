"""Generate the Grafana dashboards of cbserve: ``python dashboards/generate.py`` rewrites the JSON files
next to this script. Edit the panels here, never the JSON by hand (tests/cluster/test_metrics.py checks
that the committed JSON is what this script writes).

Metric names are the exported ones: Ray's exporter prefixes custom metrics with ``ray_`` (see
cluster/ops/metrics.py), so cbserve's series are ``ray_cbserve_*`` and Ray Serve's are ``ray_serve_*``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script or loaded from its path (the tests): its sibling module
from grafana import Board, E, M, S, dashboard, or_zero, quantile, quantiles, rate, variable  # noqa: E402

C = "ray_cbserve_"


def engine_panels(b: Board) -> None:
    """The cbserve dashboard: throughput, latency, scheduler, KV cache, batches, errors, replicas, HTTP."""
    for section in (throughput_panels, latency_panels, scheduler_panels, kv_cache_panels, batch_panels,
                    kv_tier_panels, spec_decode_panels, lora_panels, error_panels, replica_panels,
                    http_panels):  # fmt: skip
        section(b)


def throughput_panels(b: Board) -> None:
    b.row("Throughput")
    b.panel("Finished requests / s", [(rate(C + "request_finished_total", by="reason"), "{{reason}}")], "reqps",
            stack=True)  # fmt: skip
    b.panel("Embeddings / s (runner: pooling)", [(rate(C + "embedding_requests_total"), "embeddings")], "reqps")
    b.panel(
        "Tokens / s",
        [(rate(C + "prompt_tokens_total"), "prompt"), (rate(C + "generation_tokens_total"), "generation")],
        "short",
    )
    b.panel(
        "Requests running / waiting / preempted",
        [
            (f"sum(ray_cbserve_num_requests_running{E})", "running"),
            (f"sum(ray_cbserve_num_requests_waiting{E})", "waiting"),
            (f"sum(ray_cbserve_num_requests_preempted{E})", "preempted (waiting)"),
        ],
    )


def latency_panels(b: Board) -> None:
    b.row("Latency")
    b.panel("Time to first token", quantiles(C + "time_to_first_token_seconds"), "s")
    b.panel("Inter-token latency", quantiles(C + "inter_token_latency_seconds"), "s")
    b.panel("Time per output token (per request)", quantiles(C + "time_per_output_token_seconds"), "s")
    b.panel("End-to-end request latency", quantiles(C + "e2e_request_latency_seconds"), "s")
    b.panel("Queue time", quantiles(C + "request_queue_time_seconds"), "s")
    b.panel(
        "Prefill / decode time per request",
        [
            (quantile(0.5, C + "request_prefill_time_seconds"), "prefill p50"),
            (quantile(0.99, C + "request_prefill_time_seconds"), "prefill p99"),
            (quantile(0.5, C + "request_decode_time_seconds"), "decode p50"),
            (quantile(0.99, C + "request_decode_time_seconds"), "decode p99"),
        ],
        "s",
    )


def scheduler_panels(b: Board) -> None:
    b.row("Scheduler and workers")
    b.panel("Engine step time", quantiles(C + "engine_step_seconds", qs=(0.5, 0.99)), "s",
            desc="One step(): schedule + execute on the workers + update_from_output.")  # fmt: skip
    b.panel(
        "Scheduler time / Ray dispatch overhead",
        [
            (quantile(0.5, C + "scheduler_time_seconds"), "scheduler p50"),
            (quantile(0.99, C + "scheduler_time_seconds"), "scheduler p99"),
            (quantile(0.5, C + "dispatch_overhead_seconds"), "dispatch p50"),
            (quantile(0.99, C + "dispatch_overhead_seconds"), "dispatch p99"),
        ],
        "s",
        desc="Scheduler bookkeeping per step, and execute time minus worker forward time (the Ray hop).",
    )
    b.panel("Worker forward time by rank",
            quantiles(C + "worker_forward_seconds", by="replica, rank", qs=(0.5, 0.99)), "s")  # fmt: skip
    b.panel("Engine steps / s", [(rate(C + "engine_step_seconds_count", by="replica"), "{{replica}}")], "ops")


def kv_cache_panels(b: Board) -> None:
    b.row("KV cache and prefix cache")
    b.panel("KV cache usage", [(f"max by (replica)(ray_cbserve_kv_cache_usage_ratio{E})", "{{replica}}")],
            "percentunit")  # fmt: skip
    b.panel(
        "KV cache blocks",
        [
            (f"sum(ray_cbserve_kv_cache_blocks{E})", "total"),
            (f"sum(ray_cbserve_kv_cache_free_blocks{E})", "free"),
        ],
    )
    b.panel(
        "Prefix cache hit rate",
        [(f"{rate(C + 'prefix_cache_hits_total')} / {rate(C + 'prefix_cache_queries_total')}", "hit rate")],
        "percentunit",
        desc="Prompt tokens served from the prefix cache / prompt tokens looked up.",
    )
    b.panel(
        "Prefix cache tokens / s",
        [(rate(C + "prefix_cache_queries_total"), "queried"), (rate(C + "prefix_cache_hits_total"), "hit")],
    )
    b.panel("Preemptions / s", [(rate(C + "num_preemptions_total", by="replica"), "{{replica}}")], "ops")


def batch_panels(b: Board) -> None:
    b.row("Batch composition")
    b.panel(
        "Scheduled tokens / s: prefill vs decode",
        [
            (rate(C + "iteration_prefill_tokens_total"), "prefill"),
            (rate(C + "iteration_decode_tokens_total"), "decode"),
        ],
        stack=True,
    )
    b.panel("Tokens per iteration", quantiles(C + "iteration_tokens"))
    b.panel("Batch size (sequences per iteration)", quantiles(C + "iteration_batch_size"))
    b.panel("Prompt length of finished requests", quantiles(C + "request_prompt_tokens", qs=(0.5, 0.99)))
    b.panel(
        "Generated tokens per finished request", quantiles(C + "request_generation_tokens", qs=(0.5, 0.99))
    )


def kv_tier_panels(b: Board) -> None:
    b.row("KV tiers (kv_offloading_size) and retention hints")
    b.panel("Pool evictions / s and blocks kept by hints",
            [(rate(C + "kv_cache_evictions_total", by="reason"), "evicted: {{reason}}"),
             (f"sum({C}kv_cache_retained_blocks)", "free blocks kept by retention hints")], "short",
            desc="retention_overridden: a block a retention hint kept was evicted (nothing else was free).")
    hits = rate(C + "kv_tier_hit_tokens_total", by="medium")
    b.panel("Prompt tokens from the tiers / s", [(hits, "{{medium}}"),
            (rate(C + "prefix_cache_queries_total"), "looked up (pool and tiers)")], "short",
            desc="Tokens loaded from the RAM tier (disk: prefetched from disk first) instead of computed.")
    b.panel("KV bytes moved / s", [(rate(C + "kv_tier_bytes_total", by="direction"), "{{direction}}")], "Bps")
    b.panel("Tier evictions and failed prefetches / s",
            [(rate(C + "kv_tier_evictions_total", by="medium"), "evicted from {{medium}}"),
             (rate(C + "kv_tier_prefetch_failures_total"), "failed prefetches (recomputed)"),
             (rate(C + "kv_tier_pull_failures_total"), "failed pulls from a prefill engine (recomputed)"),
             (rate(C + "kv_tier_transfer_seconds_total", by="direction"), "{{direction}} seconds / s")],
            desc="Block moves between pool and RAM cost the worker the seconds shown (per second of wall time).")


def spec_decode_panels(b: Board) -> None:
    b.row("Speculative decoding")
    drafts, accepted = rate(C + "spec_decode_num_draft_tokens_total"), rate(C + "spec_decode_num_accepted_tokens_total")
    b.panel("Draft acceptance rate", [(f"{accepted} / {drafts}", "accepted / proposed")], "percentunit",
            desc="Draft tokens accepted / draft tokens proposed (0 drafts: no data).")  # fmt: skip
    b.panel("Draft tokens / s", [(drafts, "proposed"), (accepted, "accepted"),
            (f"{accepted} / {rate(C + 'spec_decode_num_drafts_total')}", "accepted per verifying step")])
    b.panel("Accepted drafts / s, by position in the draft",
            [(rate(C + "spec_decode_num_accepted_tokens_per_pos_total", by="position"), "position {{position}}"),
             (rate(C + "spec_decode_num_drafts_total"), "verifying sequence-steps")],
            desc="Divide a position's rate by the verifying steps' for its acceptance per step.")  # fmt: skip


def error_panels(b: Board) -> None:
    b.row("Errors")
    b.panel("Rejected requests / s by reason", [(rate(C + "request_rejected_total", by="reason"), "{{reason}}")],
            "reqps")  # fmt: skip
    aborted = rate(C + "request_finished_total", '{model=~"$model", replica=~"$replica", reason=~"abort|error"}',
                   "reason")  # fmt: skip
    b.panel("Aborted / errored requests / s", [(aborted, "{{reason}}")], "reqps")
    http = rate(C + "http_requests_total", '{model=~"$model", status!~"2.."}', "route, status")
    b.panel("HTTP errors / s by route and status", [(http, "{{route}} {{status}}")], "reqps")


def lora_panels(b: Board) -> None:
    b.row("LoRA adapters")
    for state in ("running", "waiting"):
        b.panel(f"Requests {state} by adapter",
                [(f"sum by (lora_name)(ray_cbserve_lora_num_requests_{state}{E})", "{{lora_name}}")], stack=True,
                desc="Engines with enable_lora: requests per adapter (base-model requests are not counted).")
    info = f"1000 * max by (replica, max_lora, running_lora_adapters)(ray_cbserve_lora_requests_info{E})"
    legend = "{{replica}} [{{max_lora}}]: {{running_lora_adapters}}"
    b.panel("Running adapter sets (lora_requests_info)", [(info, legend)], "dateTimeAsIso",
            desc="vLLM's lora_requests_info: each replica's running adapters (at most max_lora) and when that set "
            "was last seen (1970 with max_lora 0: LoRA off); waiting_lora_adapters is on the same series.")  # fmt: skip
    churn = [(rate(C + f"lora_adapter_{k}_total", by="replica"), "{{replica}} " + k) for k in ("loads", "evictions")]
    b.panel("Adapter loads and evictions / s", churn, "ops",
            desc="Adapters read into the workers' caches, and dropped past max_cpu_loras (a busy adapter is kept).")


def replica_panels(b: Board) -> None:
    b.row("Per-replica load and routing")
    for state in ("running", "waiting"):
        b.panel(f"{state.capitalize()} requests by replica",
                [(f"sum by (replica)(ray_cbserve_num_requests_{state}{E})", "{{replica}}")])  # fmt: skip
    b.panel("Generation tokens / s by replica", [(rate(C + "generation_tokens_total", by="replica"), "{{replica}}")])
    b.panel("Routing decisions / s", [(rate(C + "routing_decisions_total", M, "decision"), "{{decision}}")], "reqps",
            stack=True, desc="What sent each request to its engine replica: a prefix-cache hit (routing: cache_aware), "
            "prefix or adapter affinity, load alone, or its turn (round_robin).")  # fmt: skip
    b.panel("Cached prefix of the chosen replica (tokens)", quantiles(C + "routing_matched_prefix_tokens", M),
            desc="Cache-aware routing: prompt tokens the chosen replica's prefix cache held (0: no hit).")
    b.panel("P:D prefills / s by where", [(rate(C + "pd_prefills_total", M, "decision"), "{{decision}}")], "reqps",
            stack=True, desc="A P:D app (--pd): prompts prefilled on a prefill replica (remote) or on their decode "
            "replica, and why (short uncached prompt, prefill replicas busy, the prefill leg failed, unfit).")


def http_panels(b: Board) -> None:
    b.row("HTTP ingress")
    b.panel(
        "HTTP requests / s by route and status",
        [(rate(C + "http_requests_total", M, "route, status"), "{{route}} {{status}}")],
        "reqps",
    )
    b.panel(
        "HTTP latency by route", quantiles(C + "http_request_duration_seconds", M, "route", (0.5, 0.99)), "s"
    )
    b.panel("HTTP requests in flight", [(f"sum(ray_cbserve_http_requests_in_flight{M})", "in flight")])


def ray_serve_panels(b: Board) -> None:
    """Ray Serve's own HTTP proxy and deployment metrics for the cbserve application."""
    sr = '{application=~"$application", route!~"/-/.*"}'
    b.row("Ray Serve HTTP proxy")
    b.panel(
        "QPS by route and status",
        [(rate("ray_serve_num_http_requests_total", sr, "route, status_code"), "{{route}} {{status_code}}")],
        "reqps",
    )
    b.panel(
        "Error QPS by route and code",
        [
            (
                or_zero(rate("ray_serve_num_http_error_requests_total", sr, "route, error_code")),
                "{{route}} {{error_code}}",
            )
        ],
        "reqps",
    )
    b.panel(
        "HTTP latency by route",
        quantiles("ray_serve_http_request_latency_ms", sr, "route", (0.5, 0.99)),
        "ms",
    )
    b.panel("Ongoing HTTP requests", [("sum(ray_serve_num_ongoing_http_requests)", "ongoing")])
    b.row("Ray Serve deployments")
    b.panel(
        "Deployment QPS",
        [(rate("ray_serve_deployment_request_counter_total", S, "deployment"), "{{deployment}}")],
        "reqps",
    )
    b.panel(
        "Deployment processing latency",
        quantiles("ray_serve_deployment_processing_latency_ms", S, "deployment", (0.5, 0.99)),
        "ms",
    )
    b.panel(
        "Healthy replicas",
        [(f"sum by (deployment)(ray_serve_deployment_replica_healthy{S})", "{{deployment}}")],
    )
    b.panel(
        "Queries being processed by replicas",
        [(f"sum by (deployment)(ray_serve_replica_processing_queries{S})", "{{deployment}}")],
    )
    b.panel(
        "Queued queries (at handles)",
        [(f"sum by (deployment)(ray_serve_deployment_queued_queries{S})", "{{deployment}}")],
    )


def cbserve_dashboard() -> dict[str, Any]:
    b = Board()
    engine_panels(b)
    variables = [
        variable("model", "label_values(ray_cbserve_num_requests_running, model)", "Model"),
        variable("replica", 'label_values(ray_cbserve_num_requests_running{model=~"$model"}, replica)',
                 "Replica"),
    ]  # fmt: skip
    return dashboard("cbserve-engine", "cbserve: LLM serving", b, variables)


def ray_serve_dashboard() -> dict[str, Any]:
    b = Board()
    ray_serve_panels(b)
    variables = [variable("application", "label_values(ray_serve_deployment_replica_healthy, application)",
                          "Application")]  # fmt: skip
    return dashboard("cbserve-ray-serve", "cbserve: Ray Serve HTTP", b, variables)


def build_all() -> dict[str, dict[str, Any]]:
    return {"cbserve.json": cbserve_dashboard(), "cbserve_ray_serve.json": ray_serve_dashboard()}


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


def main() -> int:
    for name, data in build_all().items():
        (HERE / name).write_text(render(data))
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
