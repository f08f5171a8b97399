"""The names cbserve's actors go by: the one Ray namespace of the engines and the app's stores, and each engine
replica's actor name (an engine belongs to one ingress replica)."""

from __future__ import annotations

import ray

NAMESPACE = "cbserve"


def engine_actor_name(app_name: str, owner: str, index: int) -> str:
    """Engines belong to one ingress replica (``owner``): a new version of the app, or a second ingress
    replica, builds its own engines instead of adopting (and later killing) another's."""
    return f"{app_name}:{owner}:engine-{index}"


def engine_actor_names(app_name: str) -> list[str]:
    """Names of the live engine actors of an app (all its ingress replicas), in index order."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE and a["name"].startswith(f"{app_name}:")]
    return sorted(names, key=lambda n: (n.rsplit(":", 2)[1], int(n.rsplit("-", 1)[1])))
