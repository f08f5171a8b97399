"""Routing between engine replicas with many tenants: prefix-cache hit rate and TTFT of ``routing: cache_aware``
against ``affinity`` (the rule before it) and ``round_robin``, on the bundled SmolLM2-135M served by ``cbserve serve``
with 2 engine replicas on this CPU (one thread each).

Each tenant has a system prompt of its own (random token ids, ``--prefix-tokens`` long); each request is a random
tenant's system prompt followed by a short user suffix of its own, sent as token ids to /v1/completions by
``--concurrency`` clients in a closed loop. Every mode serves the same requests in the same order on a fresh
deployment. The KV cache of each replica (``--kv-blocks``; by default 3/4 of all system prompts, plus room for the
requests in flight) holds half of the tenants' prompts but not all of them: a router that sends every tenant to one
replica can keep them all cached, round robin cannot. The hit rate is the engines' own (prompt tokens served from
the prefix cache / prompt tokens looked up, /stats), next to the ideal: every tenant's prompt cached on one replica
after its first request. TTFT is measured by the client (first streamed token).

    .venv/bin/python benchmarks/bench_routing.py                      # 24 tenants, 256..1024-token prompts
    .venv/bin/python benchmarks/bench_routing.py --smoke              # a one-minute check per mode
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import describe  # noqa: E402

from cbserve.bench.client import ClientConfig, send_request  # noqa: E402
from cbserve.bench.deploy import local_deployment  # noqa: E402
from cbserve.worker.cpu import native  # noqa: E402

MODES = ("cache_aware", "affinity", "round_robin")
BLOCK = 16
VOCAB = (1000, 40000)  # token ids drawn from here: plain sub-words of SmolLM2's vocabulary


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """The tenants' system prompts and the requests (tenant, prompt token ids), the same for every mode."""
    rng = random.Random(args.seed)
    lo, hi = args.prefix_tokens
    tenants = [[rng.randrange(*VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(args.tenants)]
    requests = []
    for _ in range(args.requests):
        t = rng.randrange(args.tenants)
        suffix = [rng.randrange(*VOCAB) for _ in range(rng.randint(*args.suffix_tokens))]
        requests.append((t, tenants[t] + suffix))
    return tenants, requests


def ideal_hit_rate(requests: list[tuple[int, list[int]]], tenants: list[list[int]]) -> float:
    """Every tenant's system prompt cached (in whole blocks) on one replica after the tenant's first request."""
    seen: set[int] = set()
    hits = queries = 0
    for t, prompt in requests:
        queries += len(prompt)
        if t in seen:
            hits += min(len(tenants[t]), len(prompt) - 1) // BLOCK * BLOCK
        seen.add(t)
    return hits / queries


def max_len(args: argparse.Namespace) -> int:
    """The longest request (prompt and output), rounded up to whole blocks: the engines' max_model_len."""
    return -(-(args.prefix_tokens[1] + args.suffix_tokens[1] + args.max_tokens) // BLOCK) * BLOCK


def default_kv_blocks(args: argparse.Namespace, tenants: list[list[int]]) -> int:
    prefix_blocks = sum(len(t) // BLOCK for t in tenants)
    return int(0.75 * prefix_blocks) + args.concurrency * max_len(args) // BLOCK


def replica_stats(base_url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(base_url + "/stats", timeout=30) as r:
        return {d["replica"]: d for d in json.loads(r.read())["replicas"]}


async def closed_loop(base_url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[Any]:
    cfg = ClientConfig(base_url, "SmolLM2-135M-Instruct")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[Any] = [None] * len(prompts)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await send_request(session, cfg, prompts[i], len(prompts[i]), max_tokens)  # type: ignore[arg-type]

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*[client(session) for _ in range(concurrency)])
    return results


def run_mode(mode: str, args: argparse.Namespace, requests: list[tuple[int, list[int]]], kv_blocks: int) -> dict:
    app = {"num_replicas": 2, "routing": mode, "device": "cpu", "worker_torch_threads": 1, "worker_num_cpus": 1,
           "num_kv_blocks": kv_blocks, "max_model_len": max_len(args), "max_num_batched_tokens": 512,
           "max_num_seqs": 16}
    if args.imbalance_tokens is not None:
        app["affinity_max_imbalance_tokens"] = args.imbalance_tokens
    log = Path(tempfile.gettempdir()) / f"cbserve_bench_routing_{mode}.log"
    print(f"[{mode}] starting 2 engine replicas ({kv_blocks} KV blocks each), log: {log}", flush=True)
    with local_deployment(app, log_path=log) as base_url:
        warm = [[rng_id * 7 % 30000 + 1000 for rng_id in range(40 + k)] for k in range(4)]  # no tenant's prefix
        asyncio.run(closed_loop(base_url, warm, 2, 2))
        before = replica_stats(base_url)
        t0 = time.perf_counter()
        results = asyncio.run(closed_loop(base_url, [p for _, p in requests], args.concurrency, args.max_tokens))
        elapsed = time.perf_counter() - t0
        after = replica_stats(base_url)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"[{mode}] {len(failed)} requests failed, e.g. {failed[0]}")
    delta = {k: {f: after[k][f] - before[k][f] for f in ("prefix_cache_hits", "prefix_cache_queries",
                                                         "routed_requests", "routed_cache_hits")} for k in after}
    hits, queries = (sum(d[f] for d in delta.values()) for f in ("prefix_cache_hits", "prefix_cache_queries"))
    ttfts = sorted(r.ttft for r in results)
    return {"mode": mode, "hit_rate": hits / max(1, queries), "seconds": elapsed,
            "requests_per_s": len(results) / elapsed, "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p90_s": _pct(ttfts, 90), "per_replica": delta}  # fmt: skip


def _pct(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(round(p / 100 * (len(sorted_values) - 1))))]


def plot(results: list[dict], ideal: float, machine: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    modes = [r["mode"] for r in results]
    a1.bar(modes, [100 * r["hit_rate"] for r in results], color="#3a7")
    a1.axhline(100 * ideal, color="k", ls="--", lw=1, label=f"ideal {100 * ideal:.0f}%")
    a1.set_ylabel("prefix-cache hit rate (%)")
    a1.legend(fontsize=8)
    width = 0.27
    for j, (key, label) in enumerate((("ttft_mean_s", "mean"), ("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"))):
        a2.bar([i + (j - 1) * width for i in range(len(modes))], [r[key] for r in results], width, label=label)
    a2.set_xticks(range(len(modes)), modes)
    a2.set_ylabel("TTFT (s)")
    a2.legend(fontsize=8)
    fig.suptitle(f"{title}\n{machine}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--prefix-tokens", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"))
    ap.add_argument("--suffix-tokens", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    ap.add_argument("--requests", type=int, default=144)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=None, help="per replica (default: see the docstring)")
    ap.add_argument("--imbalance-tokens", type=int, default=None,
                    help="affinity_max_imbalance_tokens: the load bound of cache_aware and affinity (default: 4096)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="6 tenants of 64..160 tokens, 24 requests")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/routing"))
    args = ap.parse_args()
    if args.smoke:
        args.tenants, args.prefix_tokens, args.requests, args.concurrency = 6, [64, 160], 24, 2
    return args


def main() -> None:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    machine = describe(native.supported_levels()[0]).rsplit(",", 1)[0] + ", 2 engine replicas x 1 thread"
    tenants, requests = workload(args)
    kv_blocks = args.kv_blocks or default_kv_blocks(args, tenants)
    ideal = ideal_hit_rate(requests, tenants)
    results = [run_mode(mode, args, requests, kv_blocks) for mode in args.modes]
    base = next((r for r in results if r["mode"] == "round_robin"), results[-1])
    print(f"\n{machine}\n{args.tenants} tenants, system prompts {args.prefix_tokens[0]}..{args.prefix_tokens[1]} "
          f"tokens, {args.requests} requests, concurrency {args.concurrency}, {kv_blocks} KV blocks per replica")
    print(f"{'mode':>12} {'hit rate':>9} {'/ideal':>7} {'TTFT mean':>10} {'p50':>7} {'p90':>7} "
          f"{'vs ' + base['mode']:>16} {'req/s':>6}  routed (cache hits) per replica")
    for r in results:
        routed = ", ".join(f"{d['routed_requests']} ({d['routed_cache_hits']})" for d in r["per_replica"].values())
        r["ttft_mean_speedup_vs_" + base["mode"]] = base["ttft_mean_s"] / r["ttft_mean_s"]
        print(f"{r['mode']:>12} {100 * r['hit_rate']:8.1f}% {r['hit_rate'] / ideal:6.2f}x {r['ttft_mean_s']:9.3f}s "
              f"{r['ttft_p50_s']:6.3f}s {r['ttft_p90_s']:6.3f}s {base['ttft_mean_s'] / r['ttft_mean_s']:15.2f}x "
              f"{r['requests_per_s']:6.2f}  {routed}")
    print(f"{'ideal':>12} {100 * ideal:8.1f}%")
    name = "routing_smoke" if args.smoke else "routing"
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out_dir / f"{name}.json").write_text(json.dumps(
        {"machine": machine, "args": meta, "kv_blocks": kv_blocks, "ideal_hit_rate": ideal, "results": results},
        indent=1))  # fmt: skip
    title = (f"Routing, {args.tenants} tenants ({args.prefix_tokens[0]}..{args.prefix_tokens[1]}-token system "
             f"prompts), {args.requests} requests, SmolLM2-135M, 2 replicas")
    plot(results, ideal, machine, title, args.out_dir / f"{name}.png")
    print(f"wrote {args.out_dir / (name + '.json')} and .png")


if __name__ == "__main__":
    main()
