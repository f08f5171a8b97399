"""``make gpu-check DRY_RUN=1``: benchmarks/gpu_check.py runs every sub-step of both parts on the CPU with tiny
shapes (the cuda tests interpreted, FP8 emulated) and writes check.json with every key the GPU run writes, so the
GPU check cannot rot while no GPU is at hand; then the plot is drawn from it."""

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
PEERS = ("c1_1000_1000", "max_2048_128", "c250_1000_1000")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, float]:
    out = tmp_path_factory.mktemp("gpu-check")
    t0 = time.perf_counter()
    _run("benchmarks/gpu_check.py", "--dry-run", "--out", str(out))
    wall = time.perf_counter() - t0
    return json.loads((out / "check.json").read_text()), out, wall


def test_part1_correctness_and_hf_baselines(check: tuple[dict, Path, float]) -> None:
    rec, out, wall = check
    assert rec["dry_run"] is True and rec["device"].startswith("cpu")
    assert rec["commit"] and rec["commit"] == rec["parts"]["1"]["commit"] == rec["parts"]["2"]["commit"]
    kt = rec["kernel_tests"]
    assert kt["passed"] >= 1 and kt["failed"] == 0 and kt["mode"] == "interpreted", kt
    assert rec["greedy_equal"] and all(v is True for v in rec["greedy_equal"].values()), rec["greedy_equal"]
    for family in rec["greedy_equal"]:
        run = rec["greedy"][family]["fp32_eager"]
        assert run["preemptions"] > 0 and run["prefix_hits"] > 0, run  # the engine run exercised both
    hf = rec["hf"]
    assert hf["static"]["label"]["attn_implementation"] == "sdpa" and not hf["static"]["partial"]
    assert hf["static"]["batch"] == hf["static_sweep"]["best_batch"] and len(hf["static_sweep"]["rows"]) == 2
    assert hf["continuous_batching"]["label"]["attn_implementation"] and hf["continuous_batching"]["label"]["config"]
    rl = rec["rl"]  # the RL controls (gpu_check_rl.py): sleep, wake, a weight update, each checked against HF
    assert rl["level1"]["kv_cache_bytes"] > 0 and rl["level2"]["weight_bytes"] > 0 and rl["update"]["repacked"] > 0
    assert rl["update"]["weights_changed_tokens"] is True, rl
    assert {k: v for k, v in rec["goals"].items() if k.startswith("rl_")} == {
        "rl_sleep1_frees_90pct_of_kv": True, "rl_wake_up_under_2s": True, "rl_greedy_equal_after_wake_and_update": True}
    tiers = rec["kv_tiers"]  # the RAM tier on the device (gpu_check_tiers.py): tokens and real-size blocks
    assert tiers["hit_tokens_ram"] > 0 and tiers["real_size_blocks"]["blocks"] > 0, tiers
    assert rec["goals"]["kv_tiers_pinned_tokens_equal"] is True
    assert wall < 120, f"the dry run took {wall:.0f} s"  # ~25 s on two shared cores


def test_part2_steps_burst_and_timelines(check: tuple[dict, Path, float]) -> None:
    rec, out, _ = check
    tp = rec["throughput"]
    assert all(_positive(tp[k]) for k in ("cbserve", "cbserve_piecewise", "hf_continuous_batching", "hf_static")), tp
    fractions = rec["decode_roofline_fraction"]
    assert fractions and all(_positive(v) for v in fractions.values()), fractions
    for row in rec["decode"]:  # medians of interleaved repeats, each repeat kept
        assert len(row["timing"]["eager"]["repeats_ms"]) == rec["model"]["workload"]["repeats"]
    assert isinstance(rec["graphs_speedup"], dict)  # empty on the CPU: no CUDA graphs
    assert _positive(rec["prefill"]["tflops"]) and rec["mixed"] and rec["piecewise_speedup"]
    assert _positive(rec["burst_schedule"]["fraction"]) and rec["burst_schedule"]["partial"] is False
    burst = rec["e2e"]["cbserve"]
    steps = json.loads((out / burst["timeline"]["file"]).read_text())["steps"]
    assert len(steps) == burst["timeline"]["steps"] and {s["kind"] for s in steps} == {"prefill", "mixed", "decode"}
    assert all(s["forward_ms"] >= 0 and s["prep_ms"] >= 0 for s in steps)
    assert rec["e2e"]["cbserve_piecewise"]["timeline"]["paths"].get("piecewise")  # the pieces replayed
    for part in ("1", "2"):
        info = rec["parts"][part]
        assert info["errors"] == {} and not info.get("timed_out"), info
        assert all(s["ok"] for s in info["steps"].values()), info["steps"]  # nothing skipped, nothing failed
        assert (out / f"check_part{part}.log").stat().st_size > 0


def test_part2_peer_workloads(check: tuple[dict, Path, float]) -> None:
    rec, out, _ = check
    assert list(rec["peers"]) == list(PEERS)
    for row in rec["peers"].values():
        assert row["finished_requests"] == row["requests"] and row["partial"] is False, row
        assert _positive(row["output_tok_s"]) and _positive(row["ms_per_output_token"]) and row["how"]
        assert _positive(row["achieved_tflops"]) and row["card"] == "cpu"
        for pub in row["published"].values():  # no vendor figures for a CPU: nothing to scale to
            assert pub["value"] > 0 and pub["source"].startswith("https://") and pub["on_this_card"] is None
        steps = json.loads((out / row["timeline"]["file"]).read_text())["steps"]
        assert len(steps) == row["timeline"]["steps"]
    c1 = json.loads((out / rec["peers"]["c1_1000_1000"]["timeline"]["file"]).read_text())["steps"]
    assert max(s["decodes"] + s["chunks"] for s in c1) == 1  # concurrency 1: one request per step
    assert set(rec["goals"]) >= {
        "c250_1000_1000_at_least_trtllm",
        "c1_1000_1000_ms_per_token_at_most_trtllm",
        "burst_85pct_of_ideal_schedule",
        "decode_b64_80pct_of_copy_bandwidth",
    }


def test_part2_fp8_group_against_bf16(check: tuple[dict, Path, float]) -> None:
    """The FP8 group on the emulation: decode rows, the concurrency-250 window beside bf16's, the accuracy."""
    rec, out, _ = check
    fp8, repeats = rec["fp8"], rec["model"]["workload"]["repeats"]
    assert "refused" not in fp8 and fp8["settings"] == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert [r["batch"] for r in fp8["decode"]] == [1, 4] and fp8["model"]["backend"] == "torch"
    assert all(_positive(r["eager_ms"]) and len(r["timing"]["eager"]["repeats_ms"]) == repeats for r in fp8["decode"])
    bf16_run, fp8_run = rec["peers"]["c250_1000_1000"], fp8["peers"]["c250_1000_1000"]
    for window in (bf16_run["window"], fp8_run["window"]):
        assert window["reached"] and window["window_s"] == fp8["window_s"] and window["seconds"] >= fp8["window_s"]
    assert bf16_run["window"]["output_tokens"] < bf16_run["output_tokens"]  # the window is the run's start
    assert fp8_run["partial"] and fp8_run["finished_requests"] < fp8_run["requests"]  # stopped at its window
    assert abs(fp8_run["seconds"] - fp8_run["window"]["seconds"]) < 0.05 and not fp8_run["published"]
    timeline = fp8_run["timeline"]
    steps = json.loads((out / timeline["file"]).read_text())["steps"]
    assert timeline["file"] == "timeline_fp8_c250_1000_1000.json" and len(steps) == timeline["steps"]
    summary = rec["fp8_vs_bf16"]
    assert _positive(summary["decode_b1"]["ratio"]) and _positive(summary["decode_b4"]["ratio"])
    assert summary["decode_b1"]["path"] == "eager" and _positive(summary["c250_window"]["ratio"])
    acc = fp8["accuracy"]
    got = acc["results"]["fp8-both"]
    assert acc["model"].startswith("tiny") and acc["prompts"] == 2 and 0 <= got["greedy_prefix_agreement"] <= 1
    assert math.isfinite(got["mean_kl"]) and 0 <= got["mean_kl"] <= got["max_kl"]
    assert summary["accuracy"]["mean_kl"] == got["mean_kl"]
    goals = rec["goals"]
    assert goals["fp8_decode_b1_at_most_0.6x_bf16"] in (True, False) and goals["fp8_accuracy_reported"] is True
    assert goals["fp8_c250_window_at_least_1.4x_bf16"] in (True, False)
    plan = rec["parts"]["2"]["plan_s"]
    assert plan["fp8"] == sum(fp8["plan_s"].values()) and list(plan)[-2:] == ["fp8", "end"]


def test_logs_and_record_name_no_path_of_this_machine(check: tuple[dict, Path, float]) -> None:
    _, out, _ = check
    for path in [out / "check.json", out / "kernel_tests.log", *out.glob("check_part*.log")]:
        text = path.read_text()
        assert str(ROOT) not in text and str(out) not in text, path.name
    assert "rootdir: <repo>" in (out / "kernel_tests.log").read_text()


def test_the_plot_is_drawn_from_the_record(check: tuple[dict, Path, float]) -> None:
    _, out, _ = check
    _run("benchmarks/plot_gpu_check.py", "--record", str(out / "check.json"), "--out", str(out / "check.png"))
    assert (out / "check.png").stat().st_size > 10_000


def test_a_rerun_of_one_part_keeps_the_other(check: tuple[dict, Path, float]) -> None:
    """PART=1 again: part 2's figures stay in check.json, part 1's are replaced."""
    rec, out, _ = check
    _run("benchmarks/gpu_check.py", "--dry-run", "--part", "1", "--out", str(out), "--budget-s", "1")
    again = json.loads((out / "check.json").read_text())
    assert again["parts"]["2"] == rec["parts"]["2"] and again["peers"] == rec["peers"] and again["e2e"] == rec["e2e"]
    assert again["fp8"] == rec["fp8"] and again["fp8_vs_bf16"] == rec["fp8_vs_bf16"]
    assert again["throughput"]["cbserve"] == rec["throughput"]["cbserve"]
    part1 = again["parts"]["1"]
    assert part1["budget_s"] == 1 and part1["errors"] == {}
    # a 1-second budget: the tests, families and HF baselines are skipped, recorded as such, the part ends cleanly
    assert part1["steps"]["kernel_tests.start"]["skipped"] and again["kernel_tests"]["passed"] == 0
    assert part1["steps"]["hf.build"]["skipped"] and "hf" not in again
    assert again["throughput"]["hf_static"] is None
    assert again["greedy_equal"] and all(v is None for v in again["greedy_equal"].values())
