"""``cbserve bench``: load-test any OpenAI-compatible server and report latencies and throughput.

    cbserve bench --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4 \\
        --input-len 64:256 --output-len 16:256 --goodput ttft=500,tpot=50 --result-file run.json
    cbserve bench --plot run_a.json run_b.json --out fig.png

Requests stream (SSE); the load is a burst (``--request-rate inf``, the default), a Poisson process of
``--request-rate`` requests per second, and/or at most ``--max-concurrency`` requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cbserve.cluster.bench_client import ClientConfig, RequestResult, fetch_models, send_request
from cbserve.cluster.bench_datasets import SampleRequest, load_sharegpt, parse_range, sample_random
from cbserve.cluster.bench_metrics import arrival_times, format_summary, parse_goodput, summarize


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests per second; inf = send everything at once (a burst)
    max_concurrency: int | None = None  # cap on requests in flight
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 = Poisson
    seed: int = 0
    request_timeout_s: float = 600.0
    progress: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000"))
    g.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (a vLLM/cbserve extension) so outputs reach their length")
    g.add_argument("--usage", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for stream_options.include_usage (token counts from the server)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", choices=["random", "sharegpt"], default=None,
                   help="default: sharegpt when --dataset-path is given, else random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", default="128", help="prompt words (~tokens): N or LO:HI")
    g.add_argument("--output-len", default="128", help="max_tokens: N or LO:HI (random dataset)")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fix max_tokens for ShareGPT")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="words shared by every prompt")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s (Poisson); inf = burst")
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--warmup", type=int, default=0, help="requests sent (and not measured) first")
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--goodput", nargs="*", default=None, help="SLO targets, e.g. ttft=500,tpot=50 (ms)")
    g = parser.add_argument_group("output")
    g.add_argument("--result-file", default=None, help="write the results (JSON) here")
    g.add_argument("--label", default=None, help="name of this run in plots")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--plot", nargs="+", default=None, metavar="RESULT_JSON",
                   help="plot these result files instead of running a benchmark")
    g.add_argument("--plot-kind", choices=["both", "cdf", "throughput"], default="both")
    g.add_argument("--out", default="bench.png", help="figure path for --plot")
    g.add_argument("--title", default=None, help="figure title for --plot")
    g.add_argument("--caption", default=None, help="figure caption for --plot")


def main(args: argparse.Namespace) -> int:
    if args.plot:
        from cbserve.cluster.bench_plots import load_results, plot_runs

        plot_runs(load_results(args.plot), args.out, kind=args.plot_kind, title=args.title,
                  caption=args.caption)
        print(f"wrote {args.out}")
        return 0
    try:
        requests = build_requests(args)
        slo = parse_goodput(args.goodput)
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except (ValueError, OSError) as e:
        print(f"cbserve bench: {e}", file=sys.stderr)
        return 2
    if not isinstance(extra, dict):
        print("cbserve bench: --extra-body must be a JSON object", file=sys.stderr)
        return 2
    client = ClientConfig(base_url=args.base_url, model=args.model or "", endpoint=args.endpoint,
                          api_key=args.api_key, temperature=args.temperature, ignore_eos=args.ignore_eos,
                          include_usage=args.usage, extra_body=extra)
    load = LoadConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      burstiness=args.burstiness, seed=args.seed, request_timeout_s=args.request_timeout,
                      progress=not args.disable_tqdm)
    result = run_benchmark(client, requests, load, slo_ms=slo, warmup=args.warmup, label=args.label,
                           extra_config=_dataset_config(args))
    print(format_summary(result["summary"]))
    if args.result_file:
        save_result(result, args.result_file)
        print(f"results written to {args.result_file}")
    return 0 if result["summary"]["completed"] > 0 else 1


def build_requests(args: argparse.Namespace) -> list[SampleRequest]:
    dataset = args.dataset or ("sharegpt" if args.dataset_path else "random")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        return load_sharegpt(args.dataset_path, args.num_prompts, seed=args.seed,
                             output_len=args.sharegpt_output_len)
    return sample_random(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                         shared_prefix_len=args.shared_prefix_len, seed=args.seed)


def _dataset_config(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("dataset", "dataset_path", "num_prompts", "input_len", "output_len", "shared_prefix_len",
            "sharegpt_output_len", "seed", "warmup")
    return {k: getattr(args, k) for k in keys}


def run_benchmark(
    client: ClientConfig,
    requests: Sequence[SampleRequest],
    load: LoadConfig,
    slo_ms: dict[str, float] | None = None,
    warmup: int = 0,
    label: str | None = None,
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one benchmark (blocking) and return the result document saved by ``--result-file``."""
    return asyncio.run(_run(client, list(requests), load, slo_ms or {}, warmup, label, extra_config or {}))


async def _run(
    client: ClientConfig,
    requests: list[SampleRequest],
    load: LoadConfig,
    slo_ms: dict[str, float],
    warmup: int,
    label: str | None,
    extra_config: dict[str, Any],
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
        "requests": [r.to_dict() for r in results],
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
