"""benchmarks/bench_serving.py's --temperature / --top-p: what every served request's body and the offline run's
SamplingParams carry; --burst-rounds: fresh prompts per round, and goal ratios of the rounds' medians (the quick
end-to-end run in tests/e2e covers the greedy default and two rounds against a real server)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cbserve.bench.client import build_payload

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"


def _bench_serving() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _offline() -> ModuleType:
    """benchmarks/serving_offline.py, as bench_serving imports it (its folder is on sys.path once loaded)."""
    _bench_serving()
    return importlib.import_module("serving_offline")


def test_requests_are_greedy_by_default() -> None:
    bs = _bench_serving()
    args = bs.parse_args([])
    body = build_payload(bs.client_config("http://127.0.0.1:1", args), "hi", 8)
    assert body["temperature"] == 0.0 and "top_p" not in body and body["ignore_eos"] is True
    params = _offline().offline_sampling({"temperature": args.temperature, "top_p": args.top_p}, 8)
    assert params.greedy and params.max_tokens == 8 and params.ignore_eos


def test_sampling_flags_reach_the_served_requests_and_the_offline_run() -> None:
    bs = _bench_serving()
    args = bs.parse_args(["--temperature", "0.7", "--top-p", "0.95"])
    body = build_payload(bs.client_config("http://127.0.0.1:1", args), "hi", 8)
    assert body["temperature"] == 0.7 and body["top_p"] == 0.95
    params = _offline().offline_sampling({"temperature": args.temperature, "top_p": args.top_p}, 12)
    assert not params.greedy and params.temperature == 0.7 and params.top_p == 0.95 and params.max_tokens == 12


def test_burst_rounds_are_the_burst_then_fresh_prompts_of_the_same_shape() -> None:
    bs = _bench_serving()
    args = bs.parse_args(["--quick", "--burst-rounds", "3"])
    rounds = [bs.burst_requests(args, i) for i in range(args.burst_rounds)]
    burst = bs.build_workloads(args)[0]
    assert burst.name == "burst" and [r.prompt for r in rounds[0]] == [r.prompt for r in burst.requests]
    assert [len(r) for r in rounds] == [8, 8, 8]
    prompts = [{r.prompt for r in reqs} for reqs in rounds]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])


def test_goal_ratios_compare_the_rounds_medians() -> None:
    bs = _bench_serving()

    def rounds(*tputs: float) -> dict:
        return {"burst": {"summary": {"completed": 8, "output_throughput": tputs[0]}},
                "burst_rounds": [{"completed": 8, "output_throughput": t} for t in tputs]}

    results = {"cbserve": rounds(300.0, 400.0, 350.0), "offline": rounds(450.0, 400.0, 500.0)}
    served = bs.goal_ratios(results)["burst_served_over_offline"]
    assert served["value"] == pytest.approx(350.0 / 450.0) and served["met"] is False
    assert served["rounds"] == pytest.approx([300 / 450, 1.0, 350 / 500])
    one = {k: {"burst": v["burst"]} for k, v in results.items()}  # one round: the burst's own summary
    served = bs.goal_ratios(one)["burst_served_over_offline"]
    assert served["value"] == pytest.approx(300.0 / 450.0) and served["rounds"] is None


def test_exit_status_follows_every_workload_cbserve_ran() -> None:
    """A single-request run (no burst) that cbserve answered exits 0; a workload it answered none of, 1."""
    bs = _bench_serving()
    single, burst = bs.Workload("single", []), bs.Workload("burst", [])
    answered = {"single": {"summary": {"completed": 16}}}
    assert bs.cbserve_completed(answered, [single])
    assert not bs.cbserve_completed(answered, [single, burst])
    assert not bs.cbserve_completed({"single": {"summary": {"completed": 0}}}, [single])
    assert not bs.cbserve_completed({"skipped": "server did not start"}, [single])


def test_plot_bars_stand_at_the_rounds_median_for_the_workloads_that_ran() -> None:
    """serving_report.bar_values: a burst in rounds stands at its median with each round beside it, a workload
    no server ran gets no group, and offline (no TPOT) no TPOT bar."""
    _bench_serving()
    report = importlib.import_module("serving_report")

    def burst(tok_s: float, tpot: float | None = None) -> dict:
        return {"completed": 8, "output_throughput": tok_s, **({"median_tpot_ms": tpot} if tpot else {})}

    results = {
        "cbserve": {"burst": {"summary": burst(300, 100)}, "single": {"summary": burst(90, 10)},
                    "burst_rounds": [burst(300, 100), burst(360, 90), burst(330, 95)]},
        "offline": {"burst": {"summary": burst(400)}, "burst_rounds": [burst(400), burst(390), burst(420)]},
    }
    ran, tok = report.bar_values(results, "output_throughput")
    assert ran == ["burst", "single"]
    assert tok["cbserve"] == [(0, 330, [300, 360, 330]), (1, 90, [])]
    assert tok["offline"] == [(0, 400, [400, 390, 420])]
    _, tpot = report.bar_values(results, "median_tpot_ms")
    assert set(tpot) == {"cbserve"} and tpot["cbserve"][0][1] == 95
