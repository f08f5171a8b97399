"""One benchmark run of ``cbserve bench``: send a request set on an arrival schedule (a burst, a Poisson or
gamma process of ``request_rate`` requests per second, and/or at most ``max_concurrency`` in flight), stream
every answer, and return the result document (config, summary, per-request timings)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cbserve.bench.client import ClientConfig, RequestResult, fetch_models, send_request
from cbserve.bench.datasets import SampleRequest
from cbserve.bench.metrics import arrival_times, summarize


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests per second; inf = send everything at once (a burst)
    max_concurrency: int | None = None  # cap on requests in flight
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 = Poisson
    seed: int = 0
    request_timeout_s: float = 600.0
    progress: bool = True


def run_benchmark(
    client: ClientConfig,
    requests: Sequence[SampleRequest],
    load: LoadConfig,
    slo_ms: dict[str, float] | None = None,
    warmup: int = 0,
    label: str | None = None,
    extra_config: dict[str, Any] | None = None,
    include_text: bool = False,
) -> dict[str, Any]:
    """Run one benchmark (blocking) and return the result document saved by ``--result-file``
    (``include_text``: every request's ``generated_text`` too)."""
    return asyncio.run(_run(client, list(requests), load, slo_ms or {}, warmup, label, extra_config or {},
                            include_text))


async def _run(
    client: ClientConfig,
    requests: list[SampleRequest],
    load: LoadConfig,
    slo_ms: dict[str, float],
    warmup: int,
    label: str | None,
    extra_config: dict[str, Any],
    include_text: bool = False,
) -> dict[str, Any]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=load.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=load.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        if not client.model:
            models = await fetch_models(session, client)
            if not models:
                raise RuntimeError("the server lists no models; pass --model")
            client = ClientConfig(**{**asdict(client), "model": models[0]})
        for req in requests[:warmup]:
            await send_request(session, client, req.prompt, req.prompt_len, req.output_len)
        results, duration = await _drive(session, client, requests, load)
    summary = summarize(results, duration, slo_ms)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": label or f"rate={load.request_rate:g}",
        "config": {
            "base_url": client.base_url, "model": client.model, "endpoint": client.endpoint,
            "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
            "max_concurrency": load.max_concurrency, "burstiness": load.burstiness,
            "ignore_eos": client.ignore_eos, **extra_config,
        },
        "summary": summary,
        "requests": [r.to_dict(include_text) for r in results],
    }


async def _drive(session: Any, client: ClientConfig, requests: list[SampleRequest],
                 load: LoadConfig) -> tuple[list[RequestResult], float]:
    """Send ``requests`` on the arrival schedule; return their results (in order) and the duration."""
    from tqdm.asyncio import tqdm

    offsets = arrival_times(len(requests), load.request_rate, seed=load.seed, burstiness=load.burstiness)
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(requests), disable=not load.progress, desc="requests", unit="req")

    async def one(req: SampleRequest) -> RequestResult:
        if sem is None:
            res = await send_request(session, client, req.prompt, req.prompt_len, req.output_len)
        else:
            async with sem:
                res = await send_request(session, client, req.prompt, req.prompt_len, req.output_len)
        bar.update(1)
        return res

    t0 = time.perf_counter()
    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    bar.close()
    for r in results:
        r.start -= t0
    return results, duration


def save_result(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1))
