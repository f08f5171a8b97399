"""benchmarks/bench_serving.py in --quick mode against a real ``cbserve serve`` (its own local Ray instance in a
child process, the bundled SmolLM2) and cbserve offline, with vLLM and llama.cpp pointed at missing installs:
the report has every field, sane values, skip lines for the peers, the CPU breakdown names Ray's actors, a
second burst round on both sides, and the JSON and PNG are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cbserve.worker.cpu.native import supported_levels

pytestmark = [pytest.mark.ray, pytest.mark.bench, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_serving.py"


def test_quick_run_reports_cbserve_and_skips_missing_peers(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("psutil")
    out = tmp_path / "results"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--quiet", "--out-dir", str(out), "--cpu-breakdown",
           "--vllm-venv", str(tmp_path / "no-vllm"), "--llama-server", str(tmp_path / "no-llama-server"),
           "--cbserve-args", "--max-num-seqs 16 --max-model-len 512", "--burst-rounds", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[vllm] SKIPPED: vLLM not installed" in r.stdout
    assert "[llama] SKIPPED: llama-server not found" in r.stdout
    assert "Goals (issue 17):" in r.stdout and "burst_served_over_offline" in r.stdout
    doc = json.loads((out / "serving.json").read_text())
    assert doc["config"]["cpu_isa"] == supported_levels()[0]  # the ISA cbserve's kernels ran on, named
    assert f"cbserve's {doc['config']['cpu_isa']} kernels" in r.stdout
    assert (out / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = doc["results"]
    assert set(res) == {"cbserve", "vllm", "offline", "llama"}
    assert "skipped" in res["vllm"] and "skipped" in res["llama"]
    burst_lens = None
    for wl, n in (("burst", 8), ("poisson", 8), ("single", 4)):
        s = res["cbserve"][wl]["summary"]
        assert s["completed"] == n and s["failed"] == 0, res["cbserve"][wl]["requests"]
        assert 0 < s["output_throughput"] < 10_000
        for key in ("ttft", "tpot", "itl"):
            assert 0 <= s[f"median_{key}_ms"] <= s[f"p99_{key}_ms"] < 600_000, (wl, key)
        assert s["median_ttft_ms"] > 0 and s["median_tpot_ms"] > 0
        reqs = res["cbserve"][wl]["requests"]
        assert all(q["output_tokens"] == q["output_len_requested"] for q in reqs)  # ignore_eos honoured
        if wl == "burst":
            burst_lens = sum(q["output_tokens"] for q in reqs)
        if wl == "single":
            assert all(q["output_tokens"] == 16 for q in reqs)
    assert doc["config"]["poisson_rate"] == pytest.approx(0.9 * res["cbserve"]["burst"]["summary"]
                                                          ["request_throughput"])
    assert res["cbserve"]["poisson"]["config"]["request_rate"] == pytest.approx(doc["config"]["poisson_rate"])
    assert res["cbserve"]["single"]["config"]["max_concurrency"] == 1
    off = res["offline"]["burst"]["summary"]
    assert off["completed"] == 8 and off["total_output_tokens"] == burst_lens and off["output_throughput"] > 0
    ratios = doc["ratios"]
    assert ratios["burst_output_tput_cbserve_over_vllm"]["value"] is None
    assert ratios["single_median_tpot_cbserve_over_llama"]["met"] is None
    served_rounds, off_rounds = res["cbserve"]["burst_rounds"], res["offline"]["burst_rounds"]
    assert [r["completed"] for r in served_rounds + off_rounds] == [8] * 4
    assert served_rounds[0] == res["cbserve"]["burst"]["summary"] and off_rounds[0] == off
    assert served_rounds[1]["total_output_tokens"] == off_rounds[1]["total_output_tokens"]  # the same requests
    assert (out / "round1" / "logs" / "cbserve_serve.log").stat().st_size > 0  # round 1 started its own server
    assert 0 < off_rounds[1]["cpu_s"] < 10 * off_rounds[1]["duration_s"]
    tput = [[r["output_throughput"] for r in rounds] for rounds in (served_rounds, off_rounds)]
    served = ratios["burst_served_over_offline"]
    assert served["value"] == pytest.approx(sum(tput[0]) / sum(tput[1]))  # the medians of two rounds
    assert served["rounds"] == pytest.approx([a / b for a, b in zip(*tput, strict=True)])
    assert "cbserve  burst rounds, out tok/s: " in r.stdout
    cpu = {row["process"]: row["cpu_s"] for row in res["cbserve"]["burst"]["cpu_breakdown"]["by_process"]}
    for name in ("ray::SchedulerActor", "ray::ProxyActor", "client (benchmark)"):
        assert name in cpu, sorted(cpu)
    assert cpu["ray::SchedulerActor"] > 0 and "ray::WorkerActor" not in cpu  # the one rank runs in the engine actor
    assert any(k.startswith("ray::ServeReplica:") for k in cpu), sorted(cpu)
    assert "CPU time per process" in r.stdout
