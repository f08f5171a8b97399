"""cluster/ops/cpu_priority.py on real processes: every thread of a process reniced and put under SCHED_BATCH, and
the sweep over a process tree (grandchildren included): the engines' processes, the raylet, Ray's idle pooled
workers and a process that chose its own niceness left as they are, Serve's proxy at the edge's priority, the
rest behind. The served deployment's priorities are checked end to end in tests/e2e/test_serve_cli.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cbserve.cluster.ops.cpu_priority import (
    BACKGROUND,
    EDGE,
    ENGINE,
    SCHED_BATCH,
    SCHED_OTHER,
    Priority,
    background_ray_processes,
    set_priority,
)
from cbserve.cluster.ops.node_tuning import PROFILES, environment_for_ray, node_tuning

BASE = os.getpriority(os.PRIO_PROCESS, 0)  # what children of this test start at
pytestmark = [
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux /proc"),
    pytest.mark.skipif(EDGE.niceness - 2 <= BASE, reason="the tests run at the edge's niceness or behind it"),
]

# A process with three threads, printing its pid once they all run.
THREADS = (
    "import os, threading, time\n"
    "ts = [threading.Thread(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]\n"
    "[t.start() for t in ts]\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(60)\n"
)


def _niceness(tid: int) -> int:
    return int(Path(f"/proc/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _thread_priorities(pid: int) -> list[Priority]:
    return [Priority(_niceness(int(t)), os.sched_getscheduler(int(t))) for t in os.listdir(f"/proc/{pid}/task")]


def _priority(pid: int) -> Priority:
    (priority,) = set(_thread_priorities(pid))
    return priority


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the whole tree, not just its root
        p.wait()


def _start(procs: list[subprocess.Popen], argv: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    procs.append(p)
    return p


def _tree(procs: list[subprocess.Popen]) -> dict[str, int]:
    """A root shell with a plain child, a child whose argv[0] is 'raylet', ones titled like an idle Ray worker
    and like Serve's proxy, one standing for a model worker, one that will choose its niceness, and a grandchild
    under the plain child."""
    script = (
        "sleep 60 & echo plain=$!; "
        "sleep 60 & echo chose=$!; "
        "(exec -a raylet sleep 60) & echo raylet=$!; "
        "(exec -a ray::IDLE sleep 60) & echo idle=$!; "
        "(exec -a ray::ProxyActor sleep 60) & echo proxy=$!; "
        "(exec -a ray::WorkerActor sleep 60) & echo worker=$!; "
        "bash -c 'sleep 60 & echo grandchild=$!; wait' & echo mid=$!; "
        "wait"
    )
    root = _start(procs, ["bash", "-c", script])
    pids = {"root": root.pid}
    while len(pids) < 9:  # root and the eight above
        key, value = root.stdout.readline().strip().split("=")
        pids[key] = int(value)
    return pids


def test_set_priority_reaches_every_thread(procs: list[subprocess.Popen]) -> None:
    p = _start(procs, [sys.executable, "-c", THREADS])
    pid = int(p.stdout.readline())
    assert _thread_priorities(pid) == [Priority(BASE, SCHED_OTHER)] * 3
    assert set_priority(pid, Priority(BASE + 1, SCHED_BATCH)) is True
    assert _thread_priorities(pid) == [Priority(BASE + 1, SCHED_BATCH)] * 3
    assert set_priority(pid, Priority(BASE + 2)) is True
    assert _thread_priorities(pid) == [Priority(BASE + 2, SCHED_OTHER)] * 3
    p.kill()
    p.wait()
    assert set_priority(pid, Priority(BASE + 1)) is False  # gone


def test_background_sweep_keeps_the_engine_the_raylet_and_idle_workers(procs: list[subprocess.Popen]) -> None:
    pids = _tree(procs)
    _wait_titles(pids)
    set_priority(pids["chose"], Priority(BASE + 1))
    changed = background_ray_processes(pids["root"], engines=[pids["worker"]])
    assert set(changed) == {pids[k] for k in ("root", "plain", "mid", "grandchild", "proxy")}
    left = Priority(BASE, SCHED_OTHER)
    want = {"root": BACKGROUND, "plain": BACKGROUND, "grandchild": BACKGROUND, "proxy": EDGE,
            "chose": Priority(BASE + 1), "raylet": left, "idle": left, "worker": left}  # fmt: skip
    assert {key: _priority(pids[key]) for key in want} == want


def _wait_titles(pids: dict[str, int]) -> None:
    """Until each child runs under its argv[0]: the shells fork before they exec, and a process caught between the
    two is still the shell."""
    want = {"raylet": b"raylet", "idle": b"ray::IDLE", "proxy": b"ray::ProxyActor", "worker": b"ray::WorkerActor",
            "plain": b"sleep", "chose": b"sleep", "grandchild": b"sleep"}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        argv0 = {k: Path(f"/proc/{pids[k]}/cmdline").read_bytes().split(b"\0")[0] for k in want}
        if argv0 == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"children did not exec: {argv0}")


def test_bench_priority_layouts_match_what_cbserve_sets() -> None:
    """benchmarks/bench_priority.py's layouts: Ray's defaults, the one this module's sweep and the ingress's own
    call produce (so the A/B measures what `cbserve serve` runs), and that one with the scheduler actor under
    SCHED_BATCH."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_priority.py"
    spec = importlib.util.spec_from_file_location("bench_priority_under_test", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    titles = {"gcs": "/x/gcs_server", "raylet": "/x/raylet", "idle": "ray::IDLE", "proxy": "ray::ProxyActor",
              "ingress": "ray::ServeReplica:cbserve:OpenAIIngress", "controller": "ray::ServeController",
              "worker": "ray::WorkerActor", "scheduler": "ray::SchedulerActor"}  # fmt: skip
    engine = {"worker", "scheduler"}

    def layout(name: str) -> dict[str, Priority | None]:
        return {k: bench._layout_priority(name, t, k in engine) for k, t in titles.items()}

    ray, ray_actor = Priority(0), Priority(15)
    assert layout("ray") == {"gcs": ray, "raylet": None, "idle": None, "proxy": ray_actor, "ingress": ray_actor,
                             "controller": ray_actor, "worker": ray_actor, "scheduler": ray_actor}  # fmt: skip
    assert layout("cbserve") == {"gcs": BACKGROUND, "raylet": None, "idle": None, "proxy": EDGE, "ingress": EDGE,
                                 "controller": BACKGROUND, "worker": ENGINE, "scheduler": ENGINE}  # fmt: skip
    assert layout("nice") == {k: v if v is None else Priority(v.niceness) for k, v in layout("cbserve").items()}
    assert layout("batchsched") == {**layout("cbserve"), "scheduler": Priority(0, SCHED_BATCH)}


ENGINE_FIRST = PROFILES["engine-first"]


@pytest.mark.parametrize("starts", [True, False])
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_the_node_tuning_profile_reaches_only_the_ray_instance_being_started(
    monkeypatch: pytest.MonkeyPatch, starts: bool, profile: str
) -> None:
    """engine-first: `RAY_worker_niceness=0` and Serve's 0.5 s control loop are in the environment the Ray
    processes start with; off: Ray's defaults. Either way the environment is as it was once Ray started (a
    joined cluster keeps its own settings)."""
    import argparse

    from cbserve.cluster.cli import serve as serve_cli

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in ENGINE_FIRST.ray_env})
    at_start: dict[str, str | None] = {}

    def init(address: str | None, dashboard: bool) -> bool:
        at_start.update({k: os.environ.get(k) for k in ENGINE_FIRST.ray_env})
        return starts

    monkeypatch.setattr(serve_cli, "init_ray", init)
    args = argparse.Namespace(direct_ingress="auto", ray_address=None, ray_dashboard=False)
    assert serve_cli.start_ray(args, 8123, node_tuning(profile)) == (starts, starts)
    assert at_start == (dict(ENGINE_FIRST.ray_env) if profile == "engine-first" else dict.fromkeys(at_start))
    assert {k: os.environ.get(k) for k in ENGINE_FIRST.ray_env} == dict.fromkeys(ENGINE_FIRST.ray_env)


@pytest.mark.parametrize("key", sorted(ENGINE_FIRST.ray_env))
def test_a_value_the_user_set_for_the_local_ray_instance_is_kept(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    monkeypatch.setattr(os, "environ", {**os.environ, key: "5"})
    with environment_for_ray(ENGINE_FIRST.ray_env) as added:
        assert os.environ[key] == "5" and key not in added
    assert os.environ[key] == "5"


def test_profile_off_leaves_every_process_as_it_was(tmp_path: Path) -> None:
    """The off profile changes no process's priority (engine-first's sweep is tested above on the same kind
    of tree), and an unknown profile name is refused."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert PROFILES["off"].engines_ready(os.getpid(), []) == []
        assert psutil.Process(child.pid).nice() == BASE
        PROFILES["off"].edge_started()
        assert os.getpriority(os.PRIO_PROCESS, 0) == BASE
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ValueError, match="node_tuning must be one of"):
        node_tuning("fast")
    from cbserve.config import CBServeConfig

    with pytest.raises(ValueError, match="node_tuning"):
        CBServeConfig(node_tuning="fast", device="cpu")  # type: ignore[arg-type]
