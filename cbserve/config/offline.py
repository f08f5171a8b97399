"""``LLM(model, **fields)``, the offline engine, takes ``CBServeConfig``'s fields under the same names with the same
defaults (one configuration, served or offline). The fields that only mean something served (HTTP, Ray placement,
routing between replicas, Serve's autoscaler) are refused by name, each with the reason, instead of being ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cbserve.config.serve_config import CBServeConfig

_HTTP = "the HTTP server's"
# field -> what it sets, which the in-process engine does not have
SERVED_ONLY: dict[str, str] = {
    "served_model_name": "the model name HTTP clients send",
    "num_replicas": "data-parallel engine replicas behind the router",
    "worker_num_cpus": "Ray's CPUs per worker actor",
    "worker_torch_threads": "the threads of each Ray worker actor (offline: torch.set_num_threads)",
    "use_compiled_graph": "the scheduler -> Ray worker hop",
    "max_restarts": "Ray's restarts of a scheduler actor",
    "prefix_affinity_tokens": "routing between engine replicas",
    "affinity_max_imbalance_tokens": "routing between engine replicas",
    "routing": "routing between engine replicas",
    "lora_modules": "adapters served by name (offline: generate(..., lora_request=LoRARequest(...)))",
    "allow_runtime_lora_updating": "the HTTP routes that load and unload adapters (offline: any LoRARequest)",
    "lora_allowed_dirs": "the folders the HTTP load route may read adapters from",
    "host": f"{_HTTP} address",
    "port": f"{_HTTP} port",
    "route_prefix": f"{_HTTP} route",
    "app_name": "the Serve application's name",
    "api_key": f"{_HTTP} authentication",
    "max_n": f"{_HTTP} limit on n and best_of",
    "tool_call_parser": "the chat API's tool calls",
    "reasoning_parser": "the chat API's reasoning_content",
    "disable_any_whitespace": f"{_HTTP} default JSON layout (offline: SamplingParams' structured spec)",
    "request_timeout_s": f"{_HTTP} request timeout",
    "node_tuning": "the served node's CPU priorities",
    "shutdown_timeout": f"{_HTTP} drain time",
    "autoscaling": "Serve's autoscaler",
    "responses_store_max_entries": "the Responses API is served only",
    "responses_store_ttl_s": "the Responses API is served only",
}


def offline_config(model: str | None, fields: Mapping[str, Any]) -> CBServeConfig:
    """The configuration of ``LLM(model, **fields)``: a field set to None is unset (its default), as with CLI
    flags. TypeError names unknown and served-only fields; pydantic's ValidationError (a ValueError) bad values."""
    unknown = sorted(set(fields) - set(CBServeConfig.model_fields))
    if unknown:
        raise TypeError(f"unknown LLM arguments: {', '.join(unknown)} (LLM takes CBServeConfig's fields)")
    served = sorted(set(fields) & set(SERVED_ONLY))
    if served:
        why = "; ".join(f"{name}: {SERVED_ONLY[name]}" for name in served)
        raise TypeError(f"LLM runs in this process and does not take the served-only fields ({why}); "
                        "set them for `cbserve serve`")
    if "model" in fields:
        raise TypeError("LLM takes the model once, as its first argument")
    given = {k: v for k, v in fields.items() if v is not None}
    config = CBServeConfig.model_validate({"model": model, **given})
    if config.disaggregation is not None and config.disaggregation.transport == "ray":
        raise ValueError("disaggregation transport 'ray' pulls through the Ray object store of served engines; the "
                         "offline LLM hands blocks over in shared memory: use 'auto' or 'shm'")
    return config
