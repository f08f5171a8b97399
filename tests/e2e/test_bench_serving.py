"""``cbserve bench`` against a real cbserve deployment (its own local Ray instance in a child process, the
bundled SmolLM2 GGUF on CPU, a free port): a handful of short streamed requests, completions and chat."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("ray")
    pytest.importorskip("aiohttp")
    from cbserve.bench.deploy import local_deployment

    log = tmp_path_factory.mktemp("bench") / "deploy.log"
    args = {"device": "cpu", "worker_torch_threads": 1, "max_model_len": 512, "max_num_seqs": 8}
    try:
        with local_deployment(args, timeout_s=600, log_path=log) as url:
            yield url
    except (RuntimeError, TimeoutError) as e:
        tail = log.read_text()[-3000:] if log.exists() else ""
        raise RuntimeError(f"{e}\n--- deployment log tail ---\n{tail}") from e


def _check_run(doc: dict, num: int, out_lens: list[int]) -> None:
    s = doc["summary"]
    assert s["completed"] == num and s["failed"] == 0, [r["error"] for r in doc["requests"]]
    assert doc["config"]["model"] == MODEL
    for r, out_len in zip(doc["requests"], out_lens, strict=True):
        assert r["success"] and r["usage_reported"]
        assert r["output_tokens"] == out_len  # ignore_eos: every request runs to max_tokens
        assert r["prompt_tokens"] >= r["prompt_len"] * 0.8
        assert 0 < r["ttft"] <= r["latency"] < 300
        assert len(r["itl"]) >= 1 and all(x >= 0 for x in r["itl"])
    assert s["total_output_tokens"] == sum(out_lens)
    assert s["request_throughput"] > 0 and 0 < s["output_throughput"] < 10_000
    assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] <= s["p99_e2el_ms"]
    assert s["mean_tpot_ms"] > 0 and s["median_itl_ms"] > 0


def test_cli_completions_burst(base_url: str, tmp_path: Path) -> None:
    from cbserve.bench.datasets import sample_random
    from cbserve.cluster.cli.main import main

    out = tmp_path / "run.json"
    argv = ["bench", "--base-url", base_url + "/v1", "--num-prompts", "4", "--input-len", "8:24",
            "--output-len", "4:8", "--seed", "5", "--goodput", "ttft=600000,tpot=600000",
            "--result-file", str(out), "--disable-tqdm"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    _check_run(doc, 4, [r.output_len for r in sample_random(4, (8, 24), (4, 8), seed=5)])
    assert doc["summary"]["good_requests"] == 4


def test_chat_poisson_with_shared_prefix(base_url: str) -> None:
    from cbserve.bench.client import ClientConfig
    from cbserve.bench.datasets import sample_random
    from cbserve.bench.runner import LoadConfig, run_benchmark

    reqs = sample_random(3, (4, 8), (5, 5), shared_prefix_len=40, seed=1)
    client = ClientConfig(base_url=base_url, model=MODEL, endpoint="chat")
    doc = run_benchmark(client, reqs, LoadConfig(request_rate=4.0, max_concurrency=2, progress=False))
    _check_run(doc, 3, [5, 5, 5])
