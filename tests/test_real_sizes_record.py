"""The real-size serving record (benchmarks/results/real_sizes/real_sizes.json, written by
benchmarks/bench_real_sizes.py): its tables are the figures BENCHMARKS.md shows, and it names no folder of the
machine that ran it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RECORD = BENCH / "results" / "real_sizes" / "real_sizes.json"


def _modules() -> tuple[object, object]:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_real_sizes
        import real_sizes_report
    finally:
        sys.path.remove(str(BENCH))
    return bench_real_sizes, real_sizes_report


def test_the_record_gives_the_tables_benchmarks_md_shows() -> None:
    _, report = _modules()
    tables = report.format_tables(json.loads(RECORD.read_text()))
    page = (ROOT / "BENCHMARKS.md").read_text()
    rows = [line for line in tables.splitlines() if line.startswith("| cbserve bf16 |")]
    assert len(rows) == 2  # one per size
    for row in rows:  # the burst figure and its rounds, as on the page
        assert row.split("|")[2].strip() in page


def test_the_record_names_folders_by_role() -> None:
    bench, _ = _modules()
    args = argparse.Namespace(models_dir="/data/models", out_dir="out")
    text = f"--model /data/models/x.gguf log {Path('out').resolve()}/logs/a.log {bench.peers_dir()}/llama/llama-server"
    want = "--model <models-dir>/x.gguf log <out-dir>/logs/a.log <peers>/llama/llama-server"
    assert bench.portable(text, args) == want
    record = RECORD.read_text()
    assert str(Path.home()) not in record and "<models-dir>/" in record


def test_each_cbserve_variant_serves_with_its_own_flags() -> None:
    bench, _ = _modules()
    args = argparse.Namespace(max_model_len=512, kv_bytes=1 << 30, cbserve_args="")
    plain = bench.cbserve_cmd_args(Path("/m/x.gguf"), "q4_k_m", args)
    int16 = bench.cbserve_cmd_args(Path("/m/x.gguf"), "q4_k_m", args, "cbserve-int16")
    assert "--cpu-decode-activations" not in plain  # the defaults ("auto")
    assert int16[int16.index("--cpu-decode-activations") + 1] == "int16" and int16[4:] == plain
    assert int16[int16.index("--cpu-prefill-activations") + 1] == "float32"
    exact = bench.cbserve_cmd_args(Path("/m/x.gguf"), "q4_k_m", args, "cbserve-f32")
    assert exact[:4] == ["--cpu-decode-activations", "float32", "--cpu-prefill-activations", "float32"]
    assert {s for s, _ in bench.PAIRS} <= set(bench.SYSTEMS)
