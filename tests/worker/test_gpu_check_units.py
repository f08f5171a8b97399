"""The GPU check's arithmetic and bookkeeping on the CPU, without a run: timings interleaved after a warm-up,
the ideal schedule of a burst, a workload's FLOPs, published figures scaled to another card, the goals (a run
cut by its deadline fails them; FP8's against bf16's, refused on an older card), the record's summary keys, path
scrubbing, part 2's plan against its budget, FP8 weight bytes, and an engine run held to its concurrency and
measured over a window."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> dict[str, ModuleType]:
    """The check's modules, imported from benchmarks/."""
    sys.path.insert(0, str(BENCH))
    try:
        names = (
            "gpu_rooflines",
            "gpu_check_goals",
            "gpu_check_record",
            "gpu_check_engine",
            "gpu_workload",
            "gpu_check_fp8",
            "gpu_check_peers",
            "gpu_check_speed",
        )
        return {n: importlib.import_module(n) for n in names}
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture
def tiny_engine(bench: dict[str, ModuleType], tmp_path: Path) -> tuple[Any, Any]:
    """An eager executor of a tiny random model on the CPU and its serve config (at most 4 sequences a step, 64
    tokens); the test shuts the executor down."""
    gw = bench["gpu_workload"]
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
    return gw.build_cbserve(args, tmp_path, cfg, device), gw.serve_config(args, tmp_path, device)


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


def test_an_engine_run_holds_its_concurrency(bench: dict[str, ModuleType], tiny_engine: tuple[Any, Any]) -> None:
    ge, (executor, serve) = bench["gpu_check_engine"], tiny_engine
    try:
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


def _fp8_record(fp8_b1: float = 2.7, window_tok_s: float = 9000.0, **fp8_window: object) -> dict:
    """bf16's decode rows and concurrency-250 window beside the FP8 group's (graphs at batch 1; eager only at 64)."""
    bf16_rows = [{"batch": 1, "graph_ms": 5.0, "eager_ms": 18.0}, {"batch": 64, "graph_ms": 6.5, "eager_ms": 18.0}]
    fp8_rows = [{"batch": 1, "graph_ms": fp8_b1, "eager_ms": 17.0}, {"batch": 64, "graph_ms": None, "eager_ms": 9.0}]
    window = {"window_s": 40.0, "reached": True, "seconds": 40.01, "output_tokens": 1, "output_tok_s": 6000.0}
    return {
        "parts": {"2": {}},
        "decode": bf16_rows,
        "peers": {"c250_1000_1000": {"window": window}},
        "fp8": {
            "decode": fp8_rows,
            "peers": {"c250_1000_1000": {"window": {**window, "output_tok_s": window_tok_s, **fp8_window}}},
            "accuracy": {"model": "llama3-8b", "results": {"fp8-both": {
                "greedy_prefix_agreement": 0.5, "top1_agreement": 0.9, "mean_kl": 0.01, "max_kl": 0.1}}},
        },
    }  # fmt: skip


def test_fp8_goals_against_bf16(bench: dict[str, ModuleType]) -> None:
    g = bench["gpu_check_goals"]
    b1, window, reported = (
        "fp8_decode_b1_at_most_0.6x_bf16",
        "fp8_c250_window_at_least_1.4x_bf16",
        "fp8_accuracy_reported",
    )
    got = g.goals(_fp8_record())
    assert got[b1] is True and got[window] is True and got[reported] is True  # 0.54x and 1.5x
    summary = g.fp8_vs_bf16(_fp8_record())
    assert summary["decode_b1"]["path"] == "graph" and summary["decode_b1"]["ratio"] == pytest.approx(0.54)
    assert summary["decode_b64"]["path"] == "eager" and summary["decode_b64"]["ratio"] == pytest.approx(0.5)
    assert summary["c250_window"]["ratio"] == pytest.approx(1.5) and summary["accuracy"]["mean_kl"] == 0.01
    assert g.goals(_fp8_record(fp8_b1=3.1))[b1] is False  # 0.62x
    assert g.goals(_fp8_record(window_tok_s=8000.0))[window] is False  # 1.33x
    assert g.goals(_fp8_record(reached=False))[window] is False  # the FP8 run ended before its window
    assert g.goals(_fp8_record(window_s=30.0))[window] is False  # not the same window as bf16's
    missing = _fp8_record()
    del missing["fp8"]["decode"], missing["fp8"]["accuracy"]
    assert g.goals(missing)[b1] is False and g.goals(missing)[reported] is False  # part 2 ran, left no figure
    del missing["fp8"]
    assert g.goals(missing)[window] is False  # part 2 ran but never reached the FP8 group
    assert all(g.goals({})[k] is None for k in (b1, window, reported))  # part 2 has not run


def test_fp8_refused_below_compute_capability_8_9(
    bench: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own device check refuses: the group records why and builds nothing; goals: not measurable."""
    from cbserve.worker import fp8

    f8 = bench["gpu_check_fp8"]
    reason = "FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); cuda is A100, 8.0"
    monkeypatch.setattr(fp8, "fp8_device_problem", lambda device: reason)

    def build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built an FP8 model on a card that refuses it")

    monkeypatch.setattr(f8, "build_cbserve", build)
    monkeypatch.setattr(f8, "accuracy", build)
    check = bench["gpu_check_record"].Check(tmp_path, 2, {"device": "A100"}, 100.0, tmp_path)
    try:
        args = argparse.Namespace(device="cpu", max_model_len=64)
        f8.run_fp8(check, args, tmp_path, None, {}, dry_run=False)
    finally:
        check.log.close()
    rec = bench["gpu_check_record"].load_json(tmp_path / "check.json")
    assert rec["fp8"]["refused"] == f"refused: quantization='fp8', kv_cache_dtype='fp8': {reason}"
    assert rec["parts"]["2"]["errors"] == {} and rec["fp8_vs_bf16"] == {"refused": rec["fp8"]["refused"]}
    for key in ("fp8_decode_b1_at_most_0.6x_bf16", "fp8_c250_window_at_least_1.4x_bf16", "fp8_accuracy_reported"):
        assert rec["goals"][key] == f"not measurable: {rec['fp8']['refused']}"


def test_part2_plan_fits_its_budget(bench: dict[str, ModuleType]) -> None:
    speed, peers = bench["gpu_check_speed"], bench["gpu_check_peers"]
    for dry_run, budget in ((False, 290.0), (True, 90.0)):
        plan = speed.plan_s(dry_run)
        assert sum(plan.values()) <= budget, plan
        assert plan["fp8"] == sum(bench["gpu_check_fp8"].plan_s(dry_run).values())
        assert speed.reserve_after(plan, "peers") == plan["piecewise"] + plan["fp8"] + plan["end"]
        assert speed.reserve_after(plan, "piecewise") == plan["fp8"] + plan["end"]
    plan, caps = speed.plan_s(False), {w.name: w.cap_s for w in peers.peer_workloads(False)}
    assert plan["peers.c250_1000_1000"] == caps["c250_1000_1000"] and plan["peers.max_2048_128"] == caps["max_2048_128"]
    assert caps["c250_1000_1000"] > 500 * 1000 / 6058.94 + 5  # long enough to meet the H100 goal, warm-up included
    assert bench["gpu_check_fp8"].plan_s(False)["c250_window"] > peers.WINDOW_S[False]


def test_weight_bytes_count_fp8_weights_and_scales(bench: dict[str, ModuleType]) -> None:
    from cbserve.worker.layers.fp8_linear import Fp8Weight

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(100, 16)  # not read whole by a step: not counted
    model.proj = torch.nn.Linear(16, 32, bias=False)
    weight_bytes = bench["gpu_rooflines"]._weight_bytes
    assert weight_bytes(model) == 32 * 16 * 4
    model.proj.packed = Fp8Weight.quantize(model.proj.weight)
    model.proj.weight.data = torch.empty(0)
    assert weight_bytes(model) == 32 * 16 + 32 * 4  # e4m3 values, a float32 scale per output channel


def test_an_engine_run_measured_over_its_window(bench: dict[str, ModuleType], tiny_engine: tuple[Any, Any]) -> None:
    ge, (executor, serve) = bench["gpu_check_engine"], tiny_engine
    try:
        prompts = [[5 + i] * 8 for i in range(4)]
        spec = ge.RunSpec(prompts, [6] * 4, 2, time.perf_counter() + 60, window_s=0.0, stop_at_window=True)
        stopped = ge.drive(ge.new_engine(serve, executor), spec)
        spec = ge.RunSpec(prompts, [6] * 4, 2, time.perf_counter() + 60, window_s=600.0)
        whole = ge.drive(ge.new_engine(serve, executor), spec)
    finally:
        executor.shutdown()
    window = stopped["window"]  # the first step ends the window and the run
    assert window["reached"] and stopped["partial"] and stopped["finished_requests"] == 0
    assert window["output_tokens"] == stopped["output_tokens"] <= 2 and window["seconds"] > 0
    assert not whole["partial"] and whole["window"]["reached"] is False  # the run ended first: its own figures
    assert whole["window"]["output_tokens"] == whole["output_tokens"] == 24
    assert whole["window"]["output_tok_s"] == whole["output_tok_s"]
