"""benchmarks/idle_stack_cost.py: which processes of a `cbserve serve` stack each layout freezes (Ray's GCS and
raylet never: a frozen raylet would fail the node), and an unknown group is refused before anything starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

RAY = "/x/.venv/lib/python3.11/site-packages/ray"
# Command lines as Ray starts the processes of a `cbserve serve` stack (with --ray-dashboard).
STACK = {
    "ray::SchedulerActor": "engine",
    "ray::WorkerActor": "engine",
    "ray::ServeController.listen_for_change": "serve",
    "ray::ProxyActor": "serve",
    "ray::ServeReplica:cbserve:OpenAIIngress": "serve",
    f"/x/python {RAY}/dashboard/dashboard.py --host=127.0.0.1 --port=8265": "head",
    "ray-dashboard-NodeHead-0 (/x/python -B -c from multiprocessing.forkserver import main)": "head",
    f"/x/python -u {RAY}/dashboard/agent.py --node-ip-address=10.0.0.1": "agent",
    "ray::DashboardAgent": "agent",
    f"/x/python -u {RAY}/_private/log_monitor.py --session-dir=/tmp/ray/s": "monitors",
    f"/x/python -u {RAY}/autoscaler/_private/monitor.py --logs-dir=/tmp/ray/s/logs": "monitors",
    f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/s/logs": None,
    f"{RAY}/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/ray/s/sockets/raylet": None,
    "/x/python -m cbserve.cluster.cli.main serve --dtype bfloat16": None,
}


@pytest.fixture
def isc() -> ModuleType:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "idle_stack_cost.py"
    spec = importlib.util.spec_from_file_location("idle_stack_cost_under_test", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_process_is_in_its_group(isc: ModuleType) -> None:
    assert {cmd: isc.process_group(cmd) for cmd in STACK} == STACK


def test_layouts_name_the_groups_they_freeze(isc: ModuleType) -> None:
    assert isc.frozen_groups("running") == set()
    assert isc.frozen_groups("all") == {"engine", "serve", "head", "agent", "monitors"}
    assert isc.frozen_groups("head+monitors") == {"head", "monitors"}
    with pytest.raises(ValueError, match="unknown group"):
        isc.frozen_groups("head+raylet")
