"""``make gpu-check DRY_RUN=1``: benchmarks/gpu_check.py runs both parts on the CPU with tiny shapes (the cuda
tests interpreted) and writes check.json with every key of issue 37's schema, so the GPU check cannot rot
while no GPU is at hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, float]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "check.json").read_text()), out, wall


def test_schema_and_values(check: tuple[dict, Path, float]) -> None:
    rec, out, wall = check
    assert rec["dry_run"] is True and rec["device"].startswith("cpu") and rec["commit"]
    kt = rec["kernel_tests"]
    assert kt["passed"] >= 1 and kt["failed"] == 0 and kt["mode"] == "interpreted", kt
    assert rec["greedy_equal"] and all(v is True for v in rec["greedy_equal"].values()), rec["greedy_equal"]
    for family in rec["greedy_equal"]:
        run = rec["greedy"][family]["fp32_eager"]
        assert run["preemptions"] > 0 and run["prefix_hits"] > 0, run  # the engine run exercised both
    tp = rec["throughput"]
    assert set(tp) >= {"cbserve", "hf_continuous_batching", "hf_static"}
    assert all(_positive(tp[k]) for k in ("cbserve", "hf_continuous_batching", "hf_static")), tp
    fractions = rec["decode_roofline_fraction"]
    assert fractions and all(_positive(v) for v in fractions.values()), fractions
    assert all(int(b) > 0 for b in fractions)
    assert isinstance(rec["graphs_speedup"], dict)  # empty on the CPU: no CUDA graphs
    assert _positive(rec["prefill"]["tflops"])
    for part in ("1", "2"):
        info = rec["parts"][part]
        assert info["errors"] == {} and not info.get("timed_out"), info
        assert (out / f"check_part{part}.log").stat().st_size > 0
    assert (out / "kernel_tests.log").exists()
    assert wall < 180, f"the dry run took {wall:.0f} s"  # ~40 s on two idle cores


def test_a_rerun_of_one_part_keeps_the_other(check: tuple[dict, Path, float]) -> None:
    """PART=1 again: part 2's figures stay in check.json, part 1's are replaced."""
    rec, out, _ = check
    before = rec["parts"]["2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--part", "1", "--out", str(out),
                           "--budget-s", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((out / "check.json").read_text())
    assert again["parts"]["2"] == before and again["throughput"] == rec["throughput"]
    part1 = again["parts"]["1"]
    assert part1["budget_s"] == 1 and part1["errors"] == {}
    # a 1-second budget: the tests and families are skipped, recorded as such, and the part still ends cleanly
    assert part1["steps"]["kernel_tests.start"]["skipped"] and again["kernel_tests"]["passed"] == 0
    assert again["greedy_equal"] and all(v is None for v in again["greedy_equal"].values())
