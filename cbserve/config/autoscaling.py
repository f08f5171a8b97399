"""``autoscaling``: the ingress replicas (each with its ``num_replicas`` engine replicas) follow the load on Ray
Serve's autoscaler. The key takes the flag's form ``min=1,max=4,target_ongoing=2[,upscale_delay_s=S,...]``, a JSON
object, or a mapping (YAML), with Serve's own key names or the short ones below; ``CBServeConfig.from_yaml`` also
reads Serve's ``autoscaling_config`` of the ``OpenAIIngress`` deployment in a Serve config file. Every key goes to
Serve's ``AutoscalingConfig`` as it is (``serve_options``), checked here by a copy of its rules (``ServeAutoscaling``:
this package is read without ray) and by Serve itself when the app is built; its replaced smoothing keys and a
custom ``policy`` are refused by name. ``metrics_interval_s`` (how often Serve's handles report load),
which Serve calls deprecated, is taken: Ray 2.60 reads nothing else for it.

Scaling works through Serve's proxy: it queues a request while no replica can take it (a new one starting,
or none at all: ``min_replicas`` 0 scales to zero, and the first request waits for the cold start), so
``cbserve serve`` does not use direct ingress with autoscaling. A replica Serve stops (scale-down) gets no new
requests and finishes those in flight first (``graceful_shutdown_timeout_s``, from ``shutdown_timeout``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

INGRESS_DEPLOYMENT = "OpenAIIngress"  # the one Serve deployment of the app (cluster/ingress/deployment.py)

# the flag's short names, as the issue and vLLM-style flags spell them
ALIASES = {"min": "min_replicas", "max": "max_replicas", "initial": "initial_replicas",
           "target_ongoing": "target_ongoing_requests"}  # fmt: skip


class ServeAutoscaling(BaseModel):
    """The rules of Ray Serve's ``AutoscalingConfig`` (ray/serve/config.py, Ray 2.60) for the keys cbserve passes
    on: the same types, bounds, defaults and replica-count checks, without importing ray. Serve validates the
    same dict again when the app is built; tests/cluster/test_autoscaling.py runs both on the same inputs."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: NonNegativeInt = 1
    initial_replicas: NonNegativeInt | None = None
    max_replicas: PositiveInt = 1
    target_ongoing_requests: PositiveFloat | None = 2.0
    metrics_interval_s: PositiveFloat = 10.0
    look_back_period_s: PositiveFloat = 30.0
    upscaling_factor: PositiveFloat | None = None
    downscaling_factor: PositiveFloat | None = None
    downscale_delay_s: NonNegativeFloat = 600.0
    downscale_to_zero_delay_s: NonNegativeFloat | None = None
    upscale_delay_s: NonNegativeFloat = 30.0
    aggregation_function: Literal["mean", "max", "min"] = "mean"

    @field_validator("aggregation_function", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return str(value).lower()  # as Serve reads it

    @model_validator(mode="after")
    def _replicas(self) -> ServeAutoscaling:
        low, high, initial = self.min_replicas, self.max_replicas, self.initial_replicas
        if high < low:
            raise ValueError(f"max_replicas ({high}) must be greater than or equal to min_replicas ({low})!")
        if initial is not None and initial < low:
            raise ValueError(f"min_replicas ({low}) must be less than or equal to initial_replicas ({initial})!")
        if initial is not None and initial > high:
            raise ValueError(f"max_replicas ({high}) must be greater than or equal to initial_replicas ({initial})!")
        return self


# Serve's AutoscalingConfig keys that reach Serve unchanged
SERVE_KEYS = frozenset(ServeAutoscaling.model_fields)
_REFUSED = {
    "smoothing_factor": "deprecated by Serve: use upscaling_factor / downscaling_factor",
    "upscale_smoothing_factor": "deprecated by Serve: use upscaling_factor",
    "downscale_smoothing_factor": "deprecated by Serve: use downscaling_factor",
    "policy": "a custom autoscaling policy is not supported (Serve's request-based policy scales the ingress)",
}


def parse_autoscaling(value: Any) -> dict[str, Any] | None:
    """The ``autoscaling`` value as Serve's ``autoscaling_config`` (its key names; only the keys given, Serve fills
    in the rest); None when unset. Raises ValueError naming what is wrong."""
    if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none", "null"}):
        return None
    if isinstance(value, str):
        value = _from_string(value.strip())
    if not isinstance(value, Mapping):
        raise ValueError(f"autoscaling must be key=value pairs or a mapping, not {type(value).__name__}")
    given = {ALIASES.get(str(k), str(k)): v for k, v in value.items()}
    for key in given:
        if key in _REFUSED:
            raise ValueError(f"autoscaling key {key!r}: {_REFUSED[key]}")
        if key not in SERVE_KEYS:
            known = sorted({*ALIASES, *SERVE_KEYS})
            raise ValueError(f"autoscaling: unknown key {key!r} (known: {', '.join(known)})")
    if "max_replicas" not in given:
        raise ValueError("autoscaling needs max (max_replicas): the most ingress replicas Serve may run")
    return _checked_by_serve(given)


def _from_string(text: str) -> Any:
    """``min=1,max=2,target_ongoing=2`` (the flag's form) or a JSON object (a Serve app arg)."""
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"autoscaling is not valid JSON: {e}") from e
    pairs: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip() or not val.strip():
            raise ValueError(f"autoscaling: {item!r} is not key=value (e.g. min=1,max=4,target_ongoing=2)")
        pairs[key.strip()] = val.strip()
    return pairs


def _checked_by_serve(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` validated by Serve's AutoscalingConfig rules (types, min <= initial <= max), its values coerced."""
    try:
        checked = ServeAutoscaling.model_validate(given)
    except ValidationError as e:
        errors = "; ".join(
            "".join(f"{loc}: " for loc in err["loc"]) + err["msg"].removeprefix("Value error, ") for err in e.errors()
        )
        raise ValueError(f"autoscaling: {errors}") from None
    return checked.model_dump(mode="json", include=set(given))


def serve_options(autoscaling: dict[str, Any] | None) -> dict[str, Any]:
    """The ingress deployment's options for ``autoscaling`` (``Deployment.options``): none without it."""
    return {} if autoscaling is None else {"autoscaling_config": dict(autoscaling)}


def starts_at_zero(autoscaling: dict[str, Any] | None) -> bool:
    """Whether the app starts with no replica (scaled to zero until the first request)."""
    if autoscaling is None:
        return False
    initial = autoscaling.get("initial_replicas")
    return (autoscaling.get("min_replicas", 1) if initial is None else initial) == 0


def from_serve_deployments(app: Mapping[str, Any]) -> dict[str, Any]:
    """What a Serve config's application says of the ingress deployment that cbserve reads (``autoscaling``
    from its ``autoscaling_config``), as CBServeConfig fields. Raises ValueError when it says it twice."""
    for deployment in app.get("deployments") or []:
        if deployment.get("name") != INGRESS_DEPLOYMENT or deployment.get("autoscaling_config") is None:
            continue
        if (app.get("args") or {}).get("autoscaling") is not None:
            raise ValueError(f"autoscaling is set twice: in args and in the {INGRESS_DEPLOYMENT} deployment's "
                             "autoscaling_config; keep one")
        if deployment.get("num_replicas") not in (None, "auto"):
            raise ValueError(f"the {INGRESS_DEPLOYMENT} deployment sets both num_replicas and autoscaling_config")
        return {"autoscaling": deployment["autoscaling_config"]}
    return {}
