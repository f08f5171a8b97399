"""Prometheus's file service-discovery for a Ray instance that `cbserve serve` starts without Ray's dashboard.

Ray's metrics agent (one per node) exports every node's series, cbserve's included, on the node's metrics
export port. Ray's dashboard on the head node is what usually writes the file that tells Prometheus where
those ports are (``<session dir>/prom_metrics_service_discovery.json``, with a link to it in Ray's temp dir,
``/tmp/ray/prom_metrics_service_discovery.json``: deploy/prometheus.yml reads that path). `cbserve serve` starts
its local Ray instance without the dashboard by default (cluster/cli/serve.py ``--ray-dashboard``: its dozen
processes took ~3% of a served burst's throughput on a 2-core node, BENCHMARKS.md), so it writes the same
file itself, in the same format, for the nodes of that instance.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SD_FILE = "prom_metrics_service_discovery.json"  # Ray's name for it, which deploy/prometheus.yml expects


def metrics_targets(nodes: Iterable[dict[str, Any]]) -> list[str]:
    """``host:port`` of every alive node's metrics export port (``ray.nodes()`` entries)."""
    targets = []
    for node in nodes:
        if not node.get("Alive") or not node.get("MetricsExportPort"):
            continue
        host = str(node["NodeManagerAddress"])
        targets.append(f"{f'[{host}]' if ':' in host else host}:{node['MetricsExportPort']}")
    return targets


def write_discovery_file(session_dir: Path, targets: list[str]) -> Path:
    """Write the file into ``session_dir`` (atomically: Prometheus may read it meanwhile) and point
    ``<session_dir's parent>/SD_FILE`` at it (Ray's temp dir, where Ray's dashboard keeps that link too)."""
    path = session_dir / SD_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": targets}]))
    os.replace(tmp, path)
    link = session_dir.parent / SD_FILE
    link_tmp = link.with_name(link.name + f".{os.getpid()}.tmp")
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(path)
    os.replace(link_tmp, link)  # replaces the link a previous session left
    return path


def write_for_local_ray() -> Path:
    """The file for the Ray instance this process started (connected to it)."""
    import ray

    session_dir = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    return write_discovery_file(session_dir, metrics_targets(ray.nodes()))
