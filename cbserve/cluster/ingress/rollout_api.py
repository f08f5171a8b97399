"""The RL loop's controls over HTTP and over a Serve handle (the ingress's /pause, /resume, /is_paused, /sleep,
/wake_up, /is_sleeping, /reset_prefix_cache: vLLM's routes, Ray's ``LLMServer`` methods): each runs on every engine
replica of the app (rl/engines.py ``AppEngines``; cluster/engine/rollout.py does the work) and answers one body with
every replica's answer. A control an engine refuses (a bad mode, level or tag; sleep mode off) is a 400, an engine
that is not ready a 503."""

from __future__ import annotations

from typing import Any

from ray.exceptions import RayTaskError

from cbserve.frontend.protocol import APIError
from cbserve.rl.engines import AppEngines


async def run_control(app_name: str, method: str, *args: Any) -> list[dict[str, Any]]:
    """``method`` of every engine replica of ``app_name``; their answers in replica order."""
    try:
        return await AppEngines(app_name).call(method, *args)
    except RayTaskError as e:
        cause = e.cause if isinstance(e.cause, Exception) else e
        status = 400 if isinstance(cause, ValueError | TypeError) else 503
        kind = "invalid_request_error" if status == 400 else "service_unavailable"
        raise APIError(status, str(cause).strip().splitlines()[-1] if status == 503 else str(cause), kind) from e
    except RuntimeError as e:  # no engine replica runs
        raise APIError(503, str(e), "service_unavailable") from e


async def controls(app_name: str, method: str, *args: Any) -> dict[str, Any]:
    """The route's body: ``{"replicas": [...]}`` (``is_paused`` / ``is_sleeping``: whether any replica is)."""
    if method in ("is_paused", "is_sleeping"):
        states = await run_control(app_name, "rollout_state")
        key = "paused" if method == "is_paused" else "sleeping"
        return {method: any(bool(s[key]) for s in states), "replicas": states}
    return {"replicas": await run_control(app_name, method, *args)}
