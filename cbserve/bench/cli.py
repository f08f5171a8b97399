"""``cbserve bench``: load-test any OpenAI-compatible server and report latencies and throughput.

    cbserve bench --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4 \\
        --input-len 64:256 --output-len 16:256 --goodput ttft=500,tpot=50 --result-file run.json
    cbserve bench --plot run_a.json run_b.json --out fig.png

Requests stream (SSE); the load is a burst (``--request-rate inf``, the default), a Poisson process of
``--request-rate`` requests per second, and/or at most ``--max-concurrency`` requests in flight.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from cbserve.bench.client import ClientConfig
from cbserve.bench.datasets import SampleRequest, load_sharegpt, parse_range, sample_random
from cbserve.bench.metrics import format_summary, parse_goodput
from cbserve.bench.runner import LoadConfig, run_benchmark, save_result


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
        from cbserve.bench.plots import load_results, plot_runs

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
