"""Node tuning: what cbserve changes on the node it serves from, as one named profile (``node_tuning`` in the
config, ``--node-tuning`` on ``cbserve serve``), its effect logged.

- ``engine-first`` (default): the engine first on the node's CPU (``cpu_priority.py`` says why and what was
  measured). The Ray instance ``cbserve serve`` starts inherits ``ray_env`` (actors start at niceness 0,
  Serve's control loop every 0.5 s, replica code on the replica's own event loop; a value the user set wins);
  the ingress replicas put themselves at the HTTP edge's priority once started; and once the engine replicas
  are ready every other process of that Ray instance goes behind them.
- ``off``: nothing of the above; Ray's and the OS's defaults.

Ray's daemons and actors read their settings from the environment they are started with, so ``ray_env`` is
in ``os.environ`` only while ``ray.init`` starts them (``environment_for_ray``), then taken back.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from cbserve.cluster.ops.cpu_priority import BACKGROUND, EDGE, background_ray_processes, run_at_edge_priority

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class NodeTuning:
    """One profile: the environment a Ray instance ``cbserve serve`` starts inherits, and whether the engine's
    processes are put first on the node's CPU (the ingress at the edge's priority, the rest behind)."""

    name: str
    ray_env: Mapping[str, str] = field(default_factory=dict)
    engine_first: bool = False

    def edge_started(self) -> None:
        """An ingress replica finished starting: at the HTTP edge's priority when the profile says so."""
        if self.engine_first:
            run_at_edge_priority()

    def engines_ready(self, root: int, engines: Iterable[int]) -> list[int]:
        """The engine replicas of the Ray instance under ``root`` are ready (their pids ``engines``): every other
        process of it behind them when the profile says so; the pids changed, logged."""
        engines = list(engines)
        if not self.engine_first:
            return []
        changed = background_ray_processes(root, engines)
        if changed:
            logger.info("node tuning %s: the engine (pids %s) first on the CPU; %d other processes of the local Ray "
                        "instance behind it (the HTTP edge at niceness %d, the rest at %d, both under SCHED_BATCH)",
                        self.name, ", ".join(map(str, engines)), len(changed), EDGE.niceness, BACKGROUND.niceness)
        return changed


PROFILES: dict[str, NodeTuning] = {
    "engine-first": NodeTuning(
        "engine-first",
        ray_env={
            "RAY_worker_niceness": "0",
            "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        },
        engine_first=True,
    ),
    "off": NodeTuning("off"),
}


def node_tuning(name: str) -> NodeTuning:
    if name not in PROFILES:
        raise ValueError(f"node_tuning must be one of {sorted(PROFILES)}, not {name!r}")
    return PROFILES[name]


@contextlib.contextmanager
def environment_for_ray(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """``env`` in ``os.environ`` (a value already there wins) while the block starts Ray's processes, then
    ``os.environ`` as it was; yields what was added."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield added
    finally:
        for key in added:
            os.environ.pop(key, None)
