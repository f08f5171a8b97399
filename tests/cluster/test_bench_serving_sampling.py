"""benchmarks/bench_serving.py's --temperature / --top-p: what every served request's body and the offline run's
SamplingParams carry (the quick end-to-end run in tests/e2e covers the greedy default against a real server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from cbserve.bench.client import build_payload

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"


def _bench_serving() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_requests_are_greedy_by_default() -> None:
    bs = _bench_serving()
    args = bs.parse_args([])
    body = build_payload(bs.client_config("http://127.0.0.1:1", args), "hi", 8)
    assert body["temperature"] == 0.0 and "top_p" not in body and body["ignore_eos"] is True
    params = bs.offline_sampling({"temperature": args.temperature, "top_p": args.top_p}, 8)
    assert params.greedy and params.max_tokens == 8 and params.ignore_eos


def test_sampling_flags_reach_the_served_requests_and_the_offline_run() -> None:
    bs = _bench_serving()
    args = bs.parse_args(["--temperature", "0.7", "--top-p", "0.95"])
    body = build_payload(bs.client_config("http://127.0.0.1:1", args), "hi", 8)
    assert body["temperature"] == 0.7 and body["top_p"] == 0.95
    params = bs.offline_sampling({"temperature": args.temperature, "top_p": args.top_p}, 12)
    assert not params.greedy and params.temperature == 0.7 and params.top_p == 0.95 and params.max_tokens == 12
