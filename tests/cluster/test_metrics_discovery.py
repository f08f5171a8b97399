"""The Prometheus service-discovery file `cbserve serve` writes for a Ray instance it starts without Ray's
dashboard (cluster/ops/metrics_discovery.py): Ray's format and paths, so deploy/prometheus.yml finds it."""

from __future__ import annotations

import json
from pathlib import Path

from cbserve.cluster.ops.metrics_discovery import SD_FILE, metrics_targets, write_discovery_file


def test_targets_are_the_alive_nodes_metrics_ports() -> None:
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "MetricsExportPort": 8080},
        {"Alive": False, "NodeManagerAddress": "10.0.0.2", "MetricsExportPort": 8080},  # dead: not scraped
        {"Alive": True, "NodeManagerAddress": "fd00::3", "MetricsExportPort": 9090},  # IPv6 in brackets
        {"Alive": True, "NodeManagerAddress": "10.0.0.4", "MetricsExportPort": 0},  # no metrics agent
    ]
    assert metrics_targets(nodes) == ["10.0.0.1:8080", "[fd00::3]:9090"]


def test_the_file_is_rays_format_in_the_session_and_linked_from_the_temp_dir(tmp_path: Path) -> None:
    old = tmp_path / "session_old"
    old.mkdir()
    write_discovery_file(old, ["10.0.0.1:1"])
    new = tmp_path / "session_new"
    new.mkdir()
    path = write_discovery_file(new, ["10.0.0.1:8080"])
    assert path == new / SD_FILE
    assert json.loads(path.read_text()) == [{"labels": {"job": "ray"}, "targets": ["10.0.0.1:8080"]}]
    link = tmp_path / SD_FILE  # where deploy/prometheus.yml looks: now the newest session's file
    assert link.is_symlink() and link.resolve() == path.resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == [SD_FILE, "session_new", "session_old"]  # no temp left
