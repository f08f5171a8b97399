"""The GPU check's arithmetic and bookkeeping on the CPU, without a run: timings interleaved after a warm-up,
the ideal schedule of a burst, a workload's FLOPs, published figures scaled to another card, the goals (a run
cut by its deadline fails them), the record's summary keys, path scrubbing, and an engine run held to its
concurrency."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> dict[str, ModuleType]:
    """The check's modules, imported from benchmarks/."""
    sys.path.insert(0, str(BENCH))
    try:
        names = ("gpu_rooflines", "gpu_check_goals", "gpu_check_record", "gpu_check_engine", "gpu_workload")
        return {n: importlib.import_module(n) for n in names}
    finally:
        sys.path.remove(str(BENCH))


def test_interleaved_timing_warms_every_way_up_first_and_rotates_the_lead(bench: dict[str, ModuleType]) -> None:
    calls: list[str] = []
    ways = {name: (lambda name=name: calls.append(name)) for name in ("eager", "graph")}
    got = bench["gpu_rooflines"].time_interleaved(ways, torch.device("cpu"), repeats=4, iters=2, warmup=3)
    assert calls[:6] == ["eager"] * 3 + ["graph"] * 3  # warm-up of both before any timed call
    timed = calls[6:]
    leads = [timed[i] for i in range(0, len(timed), 4)]  # each round: 2 ways x 2 iters
    assert leads == ["eager", "graph", "eager", "graph"]
    assert len(got["eager"].repeats_s) == 4 and got["graph"].median_s >= 0
    assert got["eager"].record()["repeats_ms"] and got["eager"].record()["median_ms"] >= 0
    with pytest.raises(ValueError):
        bench["gpu_rooflines"].time_interleaved(ways, torch.device("cpu"), repeats=0)


def test_ideal_schedule_prefills_everything_then_decodes_the_batch_still_running(bench: dict[str, ModuleType]) -> None:
    r = bench["gpu_rooflines"]
    # 4 prompts of 100 tokens at 200 tokens per 0.1 s: 0.2 s; outputs 1, 2, 3, 3: decode steps at batch 3, then 2
    got = r.ideal_schedule([100] * 4, [1, 2, 3, 3], 200, 0.1, [(1, 0.01), (4, 0.04)])
    assert got["prefill_s"] == pytest.approx(0.2)
    assert got["decode_s"] == pytest.approx(0.03 + 0.02)
    assert got["output_tok_s"] == pytest.approx(9 / 0.25)
    assert r.interpolate([(1, 1.0), (3, 3.0)], 5) == pytest.approx(5.0)  # extended past the last point
    assert r.interpolate([(2, 4.0), (3, 3.0)], 1) == 4.0  # held below the first


def test_request_flops_of_the_8b_shape(bench: dict[str, ModuleType]) -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**bench["gpu_workload"].PRESETS["llama3-8b"])
    linear = bench["gpu_rooflines"].linear_params(cfg)
    assert 6.9e9 < linear < 7.0e9  # Llama-3.1-8B: 8.03 B parameters, 1.05 B of them in the embedding and head
    one = bench["gpu_rooflines"].request_flops(cfg, 1, 1)  # one token through the layers, one sample
    assert one == pytest.approx(2 * linear + 4 * 32 * 32 * 128 + 2 * 128256 * 4096)


def test_published_figures_scale_to_the_card(bench: dict[str, ModuleType]) -> None:
    g = bench["gpu_check_goals"]
    c250, c1 = g.PUBLISHED["trtllm_pyt_h100_bf16_c250_1000_1000"], g.PUBLISHED["trtllm_pyt_h100_bf16_c1_1000_1000"]
    same = g.scaled(c250, {"name": "NVIDIA H100 80GB HBM3", "copy_gb_s": 2900})
    assert same["on_this_card"] == c250.value and same["method"] == "same card"
    h200 = {"name": "NVIDIA H200", "copy_gb_s": 4216}
    ratio = 4.8 / 3.35
    assert g.scaled(c250, h200)["on_this_card"] == pytest.approx(6058.94 * ratio)  # more tokens/s
    assert g.scaled(c1, h200)["on_this_card"] == pytest.approx(6.0237 / ratio)  # fewer ms per token
    assert "0.88" in g.scaled(c1, h200)["method"]  # the copy efficiency measured here
    compute = g.scaled(g.PUBLISHED["trtllm_v1_h100_fp8_2048_128"], h200)
    assert compute["ratio"] == pytest.approx(1.0) and "compute" in compute["method"]
    assert g.scaled(c250, {"name": "cpu"})["on_this_card"] is None


def _record(g: ModuleType, **peer: object) -> dict:
    hw = {"name": "NVIDIA H100 80GB HBM3", "copy_gb_s": 2900}
    pub = {k: g.scaled(g.PUBLISHED[k], hw) for k in ("trtllm_pyt_h100_bf16_c250_1000_1000",)}
    row = {"output_tok_s": 6100.0, "partial": False, "published": pub, **peer}
    return {
        "peers": {"c250_1000_1000": row},
        "decode_roofline_fraction": {"64": 0.79},
        "e2e": {"cbserve": {"output_tok_s": 5000, "partial": True}},
        "burst_schedule": {"fraction": 0.9},
    }


def test_goals_fail_a_run_cut_by_its_deadline(bench: dict[str, ModuleType]) -> None:
    g = bench["gpu_check_goals"]
    assert g.goals(_record(g))["c250_1000_1000_at_least_trtllm"] is True
    assert g.goals(_record(g, output_tok_s=6000.0))["c250_1000_1000_at_least_trtllm"] is False
    assert g.goals(_record(g, partial=True))["c250_1000_1000_at_least_trtllm"] is False
    got = g.goals(_record(g))
    assert got["burst_85pct_of_ideal_schedule"] is False  # 90% of its ideal, but the burst was cut
    assert got["decode_b64_80pct_of_copy_bandwidth"] is False
    assert got["c1_1000_1000_ms_per_token_at_most_trtllm"] is None  # not measured


def test_derived_keys_come_from_the_parts(bench: dict[str, ModuleType]) -> None:
    g = bench["gpu_check_goals"]
    rec = {
        "commit": "typed",
        "parts": {"1": {"commit": "a", "device": "H200"}, "2": {"commit": "b", "device": "H200"}},
        "e2e": {"cbserve": {"output_tok_s": 10.0, "partial": True}},
        "hf": {"static": {"output_tok_s": 3.0, "partial": False}},
    }
    got = g.derived(rec)
    assert got["commit"] == "mixed: part 1 a, part 2 b" and got["device"] == "H200"
    assert got["throughput"]["cbserve"] is None and got["throughput"]["hf_static"] == 3.0
    assert set(got["goals"]) >= {"c250_1000_1000_at_least_trtllm", "burst_85pct_of_ideal_schedule"}


def test_scrub_names_no_path_of_this_machine(bench: dict[str, ModuleType]) -> None:
    scrub = bench["gpu_check_record"].scrub
    root = BENCH.parent
    text = f"rootdir: {root}\nFile {root}/benchmarks/x.py\nout {tempfile.gettempdir()}/run\nhome {Path.home()}/a"
    got = scrub(text, root)
    assert str(root) not in got and tempfile.gettempdir() not in got.replace("<tmp>", "")
    assert "rootdir: <repo>\nFile <repo>/benchmarks/x.py\nout <tmp>/run" in got


def test_an_engine_run_holds_its_concurrency(bench: dict[str, ModuleType], tmp_path: Path) -> None:
    gw, ge = bench["gpu_workload"], bench["gpu_check_engine"]
    cfg = gw.write_model_folder("tiny", tmp_path)
    args = argparse.Namespace(
        prompt_len=8,
        max_out=6,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        gpu_memory_utilization=0.5,
        attention_backend="auto",
        enforce_eager=True,
        seed=1,
    )
    device = torch.device("cpu")
    executor = gw.build_cbserve(args, tmp_path, cfg, device)
    try:
        serve = gw.serve_config(args, tmp_path, device)
        spec = ge.RunSpec([[5 + i] * 8 for i in range(6)], [6] * 6, 2, time.perf_counter() + 60)
        timeline = ge.StepTimeline(executor)
        with timeline.attached():
            got = ge.drive(ge.new_engine(serve, timeline), spec)
        rows = timeline.rows()
    finally:
        executor.shutdown()
    assert got["finished_requests"] == 6 and not got["partial"] and got["output_tokens"] == 36
    arrivals = sorted(t[0] for t in spec.times.values())
    first_finish = min(t[2] for t in spec.times.values())
    assert arrivals[2] >= first_finish  # the third request waited for a place
    assert max(r["decodes"] + r["chunks"] for r in rows) <= 2
    assert {r["kind"] for r in rows} <= {"prefill", "decode", "mixed"} and all(r["path"] == "eager" for r in rows)
    assert sum(r["tokens"] for r in rows) == 6 * 8 + 6 * 5  # every prompt token, every output token but the last


def test_the_plot_sets_each_peer_run_against_its_published_figures(bench: dict[str, ModuleType]) -> None:
    g = bench["gpu_check_goals"]
    sys.path.insert(0, str(BENCH))
    try:
        plot = importlib.import_module("plot_gpu_check")
    finally:
        sys.path.remove(str(BENCH))
    rec = _record(g)
    rec["peers"]["c1_1000_1000"] = {
        "ms_per_output_token": 5.0,
        "partial": False,
        "published": {"x": g.scaled(g.PUBLISHED["trtllm_pyt_h100_bf16_c1_1000_1000"], {"name": "NVIDIA H100"})},
    }
    bars = dict(plot.peer_bars(rec))
    assert len(bars) == 2
    c250 = next(v for k, v in bars.items() if k.startswith("c250"))
    c1 = next(v for k, v in bars.items() if k.startswith("c1"))
    assert c250 == pytest.approx(6100 / 6058.94) and c1 == pytest.approx(6.0237 / 5.0)  # above 1: better
