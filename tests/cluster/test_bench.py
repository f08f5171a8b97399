"""Fast tests of ``cbserve bench``'s pure parts: datasets, arrival schedules, metric math, plots."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from cbserve.bench.client import RequestResult
from cbserve.bench.datasets import WORDS, load_sharegpt, parse_range, sample_random
from cbserve.bench.metrics import (
    arrival_times,
    format_summary,
    parse_goodput,
    percentile,
    summarize,
    tpot,
)

# ---- datasets ---------------------------------------------------------------------------------------


def test_parse_range() -> None:
    assert parse_range("128") == (128, 128)
    assert parse_range("64:256") == (64, 256)
    assert parse_range("64-256") == (64, 256)
    assert parse_range(7) == (7, 7)
    for bad in ("", "a:b", "9:3", "1:2:3"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_random_lengths_within_ranges() -> None:
    reqs = sample_random(200, (10, 40), (3, 9), seed=1)
    assert len(reqs) == 200
    for r in reqs:
        assert 10 <= r.prompt_len <= 40 and 3 <= r.output_len <= 9
        words = r.prompt.split()
        assert len(words) == r.prompt_len and set(words) <= set(WORDS)
    assert len({r.prompt_len for r in reqs}) > 10  # lengths really vary
    assert len({r.prompt for r in reqs}) == 200


def test_random_is_seed_reproducible() -> None:
    a = sample_random(20, (5, 50), (1, 100), shared_prefix_len=8, seed=42)
    assert a == sample_random(20, (5, 50), (1, 100), shared_prefix_len=8, seed=42)
    assert a != sample_random(20, (5, 50), (1, 100), shared_prefix_len=8, seed=43)


def test_random_shared_prefix() -> None:
    reqs = sample_random(10, (4, 4), (1, 1), shared_prefix_len=32, seed=3)
    prefixes = {" ".join(r.prompt.split()[:32]) for r in reqs}
    assert len(prefixes) == 1
    assert {r.prompt_len for r in reqs} == {36}
    assert len({" ".join(r.prompt.split()[32:]) for r in reqs}) == 10


def test_random_rejects_bad_args() -> None:
    with pytest.raises(ValueError):
        sample_random(1, (1, 2), (0, 2))
    with pytest.raises(ValueError):
        sample_random(-1, (1, 2), (1, 2))


def test_sharegpt(tmp_path) -> None:
    convs = [
        {"conversations": [{"from": "human", "value": "hello there " * 10},
                           {"from": "gpt", "value": "x" * 40}]}
        for _ in range(5)
    ] + [{"conversations": [{"from": "human", "value": "alone"}]}, {"id": "junk"}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = load_sharegpt(path, 5, seed=0)
    assert len(reqs) == 5 and all(r.output_len == 10 and r.prompt_len == 30 for r in reqs)
    assert all(r.output_len == 7 for r in load_sharegpt(path, 3, output_len=7))
    with pytest.raises(ValueError, match="only 5 usable"):
        load_sharegpt(path, 6)


# ---- arrivals ---------------------------------------------------------------------------------------


def test_burst_arrivals() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_poisson_mean_rate_and_seed() -> None:
    times = arrival_times(4000, 8.0, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.06)
    # exponential gaps: std ~ mean
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8.0, rel=0.1)
    assert times == arrival_times(4000, 8.0, seed=7)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


# ---- metrics ----------------------------------------------------------------------------------------


def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) == 0.0


def test_goodput_parsing() -> None:
    assert parse_goodput("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500", "e2el=2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in ("ttft", "foo=3", "ttft=x", "tpot=-1"):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def _result(ttft: float, itl: list[float], out_tokens: int, success: bool = True) -> RequestResult:
    return RequestResult(prompt_len=10, output_len_requested=out_tokens, success=success, ttft=ttft,
                         latency=ttft + sum(itl), itl=list(itl), prompt_tokens=10, output_tokens=out_tokens)


def test_tpot_itl_and_throughput_from_hand_made_timings() -> None:
    assert tpot(1.0, 0.1, 1) is None
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    results = [
        _result(0.1, [0.02, 0.02, 0.02], 4),  # tpot 20 ms
        _result(0.3, [0.05, 0.05], 3),  # tpot 50 ms
        _result(0.2, [], 1),  # no tpot
        _result(0.0, [], 0, success=False),
    ]
    s = summarize(results, duration_s=2.0, slo_ms={"ttft": 250, "tpot": 30})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_output_tokens"] == 8 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(35.0)
    assert s["mean_itl_ms"] == pytest.approx((3 * 20 + 2 * 50) / 5)
    assert s["median_itl_ms"] == pytest.approx(20.0)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 400 + 200) / 3)
    assert s["p99_ttft_ms"] == pytest.approx(percentile([100.0, 300.0, 200.0], 99))
    # good: request 1 (ttft 100, tpot 20) and request 3 (ttft 200, no tpot); request 2 misses both
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(1.0)
    text = format_summary(s)
    assert "Request goodput" in text and "Median TTFT (ms)" in text


def test_summary_of_no_success_is_zero_not_error() -> None:
    s = summarize([_result(0, [], 0, success=False)], duration_s=1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["p99_e2el_ms"] == 0.0


# ---- plots ------------------------------------------------------------------------------------------


def _run_doc(label: str, rate: float | str, scale: float) -> dict:
    reqs = [_result(0.05 * scale * (i + 1), [0.01 * scale] * 5, 6) for i in range(20)]
    s = summarize(reqs, duration_s=3.0)
    return {"label": label, "config": {"request_rate": rate}, "summary": s,
            "requests": [r.to_dict() for r in reqs]}


@pytest.mark.parametrize("kind", ["both", "cdf", "throughput"])
def test_plot_writes_png(tmp_path, kind: str) -> None:
    pytest.importorskip("matplotlib")
    from cbserve.bench.plots import load_results, plot_runs

    paths = []
    for i, (label, rate, scale) in enumerate(
        [("static", 1.0, 3.0), ("static", 4.0, 5.0), ("continuous", 1.0, 1.0), ("continuous", "inf", 2.0)]
    ):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(_run_doc(label, rate, scale)))
        paths.append(p)
    out = tmp_path / "sub" / "fig.png"
    plot_runs(load_results(paths), out, kind=kind, title="t", caption="hardware: test")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_cli(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from cbserve.cluster.cli.main import main

    p = tmp_path / "a.json"
    p.write_text(json.dumps(_run_doc("a", 2.0, 1.0)))
    out = tmp_path / "fig.png"
    assert main(["bench", "--plot", str(p), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


# ---- report helpers ---------------------------------------------------------------------------------


def test_replace_section_is_idempotent(tmp_path) -> None:
    from cbserve.bench.report import markdown_table, replace_section

    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nintro\n")
    replace_section(md, "study", "first")
    replace_section(md, "study", "second\n")
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n")
    assert text.count("<!-- study:begin -->") == 1 and "second" in text and "first" not in text
    md.write_text(text + "\ntail\n")
    replace_section(md, "study", "third")
    assert md.read_text().endswith("<!-- study:end -->\n\ntail\n")
    md.write_text("<!-- study:end --> <!-- study:begin -->")
    with pytest.raises(ValueError):
        replace_section(md, "study", "x")
    table = markdown_table(["a", "b"], [["x", 1.234], ["y", 1234.5]])
    assert table.splitlines()[2] == "| x | 1.23 |" and "1,234" in table


def test_hardware_strings(tmp_path) -> None:
    from cbserve.bench.report import cpu_model, git_commit, hardware_summary

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n")
    assert cpu_model(info) == "Test CPU 9000"
    assert "cores" in hardware_summary()
    assert git_commit(tmp_path) == "unknown"


def test_local_deployment_runs_cbserve_serve(tmp_path) -> None:
    """The throw-away deployment is ``cbserve serve`` on its own local Ray: its command line parses with the
    serve subcommand's own flags, and the config file it writes is read back as CBServeConfig."""
    import argparse

    from cbserve.bench.deploy import serve_command
    from cbserve.cluster.cli import serve as serve_cli
    from cbserve.config import CBServeConfig

    cmd = serve_command(tmp_path / "c.yaml", 4321, 90.0)
    assert cmd[1:5] == ["-m", "cbserve.cluster.cli.main", "serve", "--ray-address"]
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(cmd[4:])
    assert (args.ray_address, args.host, int(args.port), float(args.ready_timeout)) == ("local", "127.0.0.1", 4321, 90)
    (tmp_path / "c.yaml").write_text(json.dumps({"device": "cpu", "max_num_seqs": 8}))
    config = CBServeConfig.from_yaml(args.config)
    assert config.device == "cpu" and config.max_num_seqs == 8
    joined = parser.parse_args(serve_command(tmp_path / "c.yaml", 4321, 90.0, ray_address="127.0.0.1:6379")[4:])
    assert joined.ray_address == "127.0.0.1:6379"  # a running cluster (simulated nodes) is joined


def test_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    import random
    import socket

    from cbserve.bench.deploy import FREE_PORT_RANGE, free_port

    rng = random.Random(3)
    taken = free_port(random.Random(3))
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))  # held: the same draw must now skip it
        again = free_port(rng)
        assert again != taken and FREE_PORT_RANGE[0] <= again < FREE_PORT_RANGE[1]
    from pathlib import Path

    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not lo <= taken <= hi  # the kernel never hands it to a bind(0) or an outgoing connection
