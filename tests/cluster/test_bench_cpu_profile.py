"""The per-process CPU sampler of ``cbserve.bench.cpu_profile`` on real child processes (one burns CPU under a
Ray-style process title, one sleeps), its labels, py-spy's collapsed-stack summary, and the serving report's
goal ratios, and ``bench.deploy.server_process`` (start, wait healthy, stop) on a plain HTTP server."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cbserve.bench.cpu_profile import CpuSampler, format_cpu_table, process_label, top_frames

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_process_label_uses_ray_titles_and_executables() -> None:
    assert process_label(["ray::SchedulerActor.run_loop()"], "python") == "ray::SchedulerActor"
    assert process_label(["ray::WorkerActor"], "python") == "ray::WorkerActor"
    assert process_label(["ray::ServeReplica:cbserve:OpenAIIngress.handle_request"], "x") == \
        "ray::ServeReplica:cbserve:OpenAIIngress"
    assert process_label(["/venv/lib/ray/core/src/ray/raylet/raylet", "--x"], "raylet") == "raylet"
    assert process_label(["/venv/ray/core/src/ray/gcs/gcs_server", "--y"], "gcs_server") == "gcs_server"
    assert process_label(["/usr/bin/python", "-m", "cbserve.cluster.cli.main", "serve"], "python") == \
        "cbserve.cluster.cli.main"
    assert process_label([], "sleep") == "sleep"


def test_sampler_charges_cpu_to_the_process_that_used_it() -> None:
    psutil = pytest.importorskip("psutil")
    # The root sleeps; on a line from stdin it starts a child that burns ~0.6 s of CPU and exits.
    code = ("import subprocess, sys, time\n"
            "sys.stdin.readline()\n"
            f"subprocess.Popen([sys.executable, '-c', {BURN.format(s=0.6)!r}]).wait()\n"
            "time.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        with CpuSampler(root.pid, interval_s=0.05) as sampler:
            root.stdin.write("go\n")
            root.stdin.flush()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.2)
                if not psutil.Process(root.pid).children() and len(sampler.procs) > 1:
                    break
        rep = sampler.report()
    finally:
        root.kill()
        root.wait()
    per_pid = {d["pid"]: d["cpu_s"] for d in rep["per_pid"]}
    assert per_pid.get(root.pid, 0.0) < 0.3  # the root only waits (its start-up is before the sampler)
    child = [d for d in rep["per_pid"] if d["pid"] != root.pid]
    assert child and 0.3 < child[0]["cpu_s"] < 1.5, rep
    assert rep["total_cpu_s"] == pytest.approx(sum(r["cpu_s"] for r in rep["by_process"]))
    assert "CPU time per process" in format_cpu_table(rep)


def test_top_frames_counts_leaf_frames() -> None:
    raw = "main (a.py:1);loop (a.py:5);wait (b.py:9) 30\nmain (a.py:1);step (a.py:7) 10\nbad line\n"
    frames = top_frames(raw, 5)
    assert frames[0] == ("wait (b.py:9)", pytest.approx(0.75))
    assert frames[1] == ("step (a.py:7)", pytest.approx(0.25))
    assert top_frames("", 5) == []


def test_goal_ratios_and_dispatch_share() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from serving_report import goal_ratios
    finally:
        sys.path.pop(0)

    def s(tput: float, ttft: float, tpot: float) -> dict:
        return {"summary": {"completed": 4, "output_throughput": tput, "median_ttft_ms": ttft,
                            "median_tpot_ms": tpot, "duration_s": 10.0}}

    burst = s(300.0, 1000.0, 50.0)
    burst["stats_before"] = {"replicas": [{"dispatch_calls": 10, "dispatch_overhead_ms_mean": 2.0}]}
    burst["stats_after"] = {"replicas": [{"dispatch_calls": 110, "dispatch_overhead_ms_mean": 1.2,
                                          "compiled_graph": False}]}
    results = {"cbserve": {"burst": burst, "single": s(40.0, 30.0, 10.0)},
               "vllm": {"burst": s(200.0, 2000.0, 60.0)}, "offline": {"burst": s(400.0, 0, 0)},
               "llama": {"skipped": "absent"}}
    r = goal_ratios(results)
    assert r["burst_output_tput_cbserve_over_vllm"] == {"value": 1.5, "goal": ">= 1.5", "met": True, "rounds": None}
    assert r["burst_median_ttft_cbserve_over_vllm"]["value"] == 0.5
    assert r["burst_median_tpot_cbserve_over_vllm"]["met"] is True
    assert r["burst_served_over_offline"] == {"value": 0.75, "goal": ">= 0.85", "met": False, "rounds": None}
    assert r["single_median_tpot_cbserve_over_llama"] == {"value": None, "goal": "<= 1", "met": None}
    d = r["cbserve_burst_dispatch"]
    assert d["steps"] == 100 and d["mean_overhead_ms"] == pytest.approx((132 - 20) / 100)
    assert d["overhead_share"] == pytest.approx(0.112 / 10.0) and d["compiled_graph"] is False


def test_server_process_waits_for_health_and_stops_the_server(tmp_path: Path) -> None:
    from cbserve.bench.deploy import free_port, server_process

    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    (tmp_path / "health").write_text("ok")
    with server_process(cmd, f"http://127.0.0.1:{port}", timeout_s=60, log_path=tmp_path / "log") as proc:
        assert proc.poll() is None
    assert proc.poll() is not None  # stopped on leaving
    assert "GET /health" in (tmp_path / "log").read_text()
