"""``cbserve bench`` end to end against a tiny in-process fake OpenAI server (aiohttp.web, free port)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from cbserve.bench.client import ClientConfig  # noqa: E402
from cbserve.bench.datasets import sample_random  # noqa: E402
from cbserve.bench.runner import LoadConfig, run_benchmark  # noqa: E402

TOKEN_DELAY_S = 0.005


class FakeServer:
    """Streams ``max_tokens`` one-word chunks; a prompt starting with "FAIL" gets a 400."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if prompt.startswith("FAIL"):
            err = {"error": {"message": "bad", "type": "invalid_request_error"}}
            return web.json_response(err, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if chat:  # a role-only first chunk, as OpenAI sends
                await self._send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(body["max_tokens"]):
                await asyncio.sleep(TOKEN_DELAY_S)
                piece = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
                await self._send(resp, {"choices": [{"index": 0, **piece}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": body["max_tokens"]}
                await self._send(resp, {"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, obj: dict) -> None:
        await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with FakeServer() as s:
        yield s


def _client(server: FakeServer, **kw) -> ClientConfig:
    return ClientConfig(base_url=f"http://127.0.0.1:{server.port}", model="", **kw)


def test_burst_completions_measures_every_token(server: FakeServer) -> None:
    reqs = sample_random(8, (5, 10), (3, 12), seed=0)
    res = run_benchmark(_client(server), reqs, LoadConfig(progress=False), slo_ms={"ttft": 10_000})
    s = res["summary"]
    assert s["completed"] == 8 and s["failed"] == 0 and s["good_requests"] == 8
    assert res["config"]["model"] == "fake-model"  # taken from /v1/models
    assert s["total_output_tokens"] == sum(r.output_len for r in reqs)
    for r, sample in zip(res["requests"], reqs, strict=True):
        assert r["usage_reported"] and r["output_tokens"] == sample.output_len
        assert len(r["itl"]) == sample.output_len - 1
        assert r["ttft"] >= TOKEN_DELAY_S * 0.5 and r["latency"] >= r["ttft"]
    assert s["median_itl_ms"] >= TOKEN_DELAY_S * 1e3 * 0.5
    body = server.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}


def test_chat_without_usage_counts_chunks(server: FakeServer) -> None:
    reqs = sample_random(3, (5, 5), (4, 4), seed=1)
    cfg = _client(server, endpoint="chat", include_usage=False, ignore_eos=False)
    res = run_benchmark(cfg, reqs, LoadConfig(progress=False))
    assert res["summary"]["completed"] == 3
    assert all(not r["usage_reported"] and r["output_tokens"] == 4 for r in res["requests"])
    assert "ignore_eos" not in server.bodies[-1] and "messages" in server.bodies[-1]


def test_concurrency_cap_and_poisson(server: FakeServer) -> None:
    server.max_in_flight = 0
    reqs = sample_random(12, (5, 5), (10, 10), seed=2)
    res = run_benchmark(_client(server), reqs, LoadConfig(max_concurrency=2, progress=False))
    assert res["summary"]["completed"] == 12 and server.max_in_flight <= 2
    t0 = time.perf_counter()
    res = run_benchmark(_client(server), reqs[:6], LoadConfig(request_rate=50.0, seed=3, progress=False))
    assert res["summary"]["completed"] == 6 and time.perf_counter() - t0 < 5
    starts = [r["start"] for r in res["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0
    assert res["config"]["request_rate"] == 50.0 and not math.isinf(res["config"]["request_rate"])


def test_failures_are_reported_not_raised(server: FakeServer) -> None:
    reqs = sample_random(2, (5, 5), (3, 3), seed=4)
    from cbserve.bench.datasets import SampleRequest

    reqs.append(SampleRequest(prompt="FAIL please", prompt_len=2, output_len=3))
    res = run_benchmark(_client(server), reqs, LoadConfig(progress=False))
    assert res["summary"]["completed"] == 2 and res["summary"]["failed"] == 1
    assert "HTTP 400" in res["requests"][-1]["error"]
    dead = ClientConfig(base_url="http://127.0.0.1:9", model="m")  # nothing listens on port 9
    res = run_benchmark(dead, reqs[:1], LoadConfig(progress=False, request_timeout_s=5))
    assert res["summary"]["failed"] == 1 and res["requests"][0]["error"]


def test_cli_writes_result_file(server: FakeServer, tmp_path) -> None:
    from cbserve.cluster.cli.main import main

    out = tmp_path / "res.json"
    argv = ["bench", "--base-url", f"http://127.0.0.1:{server.port}/v1", "--num-prompts", "4",
            "--input-len", "4:8", "--output-len", "2:5", "--goodput", "ttft=5000,tpot=1000",
            "--result-file", str(out), "--label", "fake", "--disable-tqdm", "--warmup", "1"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["label"] == "fake" and doc["summary"]["completed"] == 4
    assert doc["summary"]["request_goodput"] > 0 and doc["config"]["input_len"] == "4:8"
    assert main(["bench", "--num-prompts", "0"]) == 2
