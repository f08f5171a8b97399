"""benchmarks/bench_spec_serving.py in --quick mode: two real ``cbserve serve`` deployments (each its own local
Ray instance in a child process, the bundled SmolLM2), without and with the n-gram ``speculative_config``, the
grounded (chat) and burst (completions) workloads at concurrency 1 and 4. Every row is reported, drafts were
proposed and accepted on the grounded workload (the server's /stats counters) and none without speculation,
greedy texts are identical with and without speculation, and the ratios are those of the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.bench, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_spec_serving.py"


def test_quick_run_reports_every_row_with_acceptance_and_same_outputs(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "results"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--quiet", "--out-dir", str(out),
           "--cbserve-args", "--max-num-seqs 16 --max-model-len 512"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[off] ready in" in r.stdout and "[spec] ready in" in r.stdout
    assert "| workload | c | tok/s off | tok/s spec |" in r.stdout
    doc = json.loads((out / "bench_spec_serving.json").read_text())
    assert doc["meta"]["speculative_config"]["method"] == "ngram"
    rows = {(row["workload"], row["concurrency"]): row for row in doc["rows"]}
    assert set(rows) == {("grounded", 1), ("grounded", 4), ("burst", 1), ("burst", 4)}
    for (workload, conc), row in rows.items():
        n = 2 if conc == 1 else conc
        assert row["requests"] == n
        off, on = row["off"], row["spec"]
        for res in (off, on):
            assert res["completed"] == n and res["failed"] == 0, res["errors"]
            assert res["tok_s"] > 0 and res["median_tpot_ms"] > 0 and res["median_ttft_ms"] > 0
        assert off["draft_tokens"] == 0 and off["acceptance_rate"] is None  # the baseline never drafts
        assert row["same_outputs"] and row["num_different_outputs"] == 0, (workload, conc)
        assert on["output_tokens"] == off["output_tokens"]
        if workload == "burst":  # ignore_eos: every output is one of the quick lengths (16 or 32)
            assert 16 * n <= off["output_tokens"] <= 32 * n
        assert row["tpot_speedup"] == pytest.approx(off["median_tpot_ms"] / on["median_tpot_ms"])
        assert row["throughput_ratio"] == pytest.approx(on["tok_s"] / off["tok_s"])
    for conc in (1, 4):
        on = rows[("grounded", conc)]["spec"]
        assert on["draft_tokens"] > 0 and 0 < on["accepted_tokens"] <= on["draft_tokens"]
        assert on["acceptance_rate"] > 0
        assert on["acceptance_rate"] == pytest.approx(on["accepted_tokens"] / on["draft_tokens"])
    assert (out / "logs" / "spec_serving_spec.log").exists()
