"""Prefill/decode disaggregation served, against the colocated engine on the same cores: steady decoding streams
(--streams of them, short prompts, --stream-tokens each, sent again as each ends) while a long prompt (--long-tokens
of fresh token ids: no prefix hit) arrives every --period seconds, for --duration seconds per way, over HTTP
(streamed completions through the real server), with the engines' step budget (a prefill chunk) at
--max-num-batched-tokens. The two ways:

- colocated: one engine replica with every worker core (``worker_num_cpus`` = ``worker_torch_threads`` = --cores);
- P:D: ``--pd 1:1``, a prefill and a decode replica with half the cores each (the hand-off through shared memory).

Reported per way: the steady streams' inter-token latency (gaps between streamed tokens) p50 and p99, and the long
prompts' TTFT p50 and p90 (client side), then the ratios P:D / colocated. Writes ``pd_served.json`` and ``.png`` to
--out-dir.

    .venv/bin/python benchmarks/bench_pd_served.py              # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import cpu_model  # noqa: E402

from cbserve.bench.deploy import local_deployment  # noqa: E402

MODEL = "smollm2"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def stream_tokens(client: Any, prompt: Any, max_tokens: int) -> list[float]:
    """The arrival times of the streamed chunks of one completion (a token each: the engine streams every step's)."""
    out = []
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            out.append(time.perf_counter())
    return out


def run_way(name: str, app: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import openai

    rng = random.Random(args.seed)
    itls: list[float] = []
    ttfts: list[float] = []
    errors: list[str] = []
    with local_deployment(app, timeout_s=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        stream_tokens(client, "Warm up.", 4)
        stop = time.perf_counter() + args.duration

        def steady(k: int) -> None:
            while time.perf_counter() < stop:
                try:
                    times = stream_tokens(client, f"Stream {k}: tell me a story about the number {rng.random()}.",
                                          args.stream_tokens)
                    itls.extend(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
                except Exception as e:  # noqa: BLE001 - counted, reported
                    errors.append(repr(e))

        def long_one(prompt: list[int]) -> None:
            t0 = time.perf_counter()
            try:
                times = stream_tokens(client, prompt, 8)
                ttfts.append(times[0] - t0)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=steady, args=(k,)) for k in range(args.streams)]
        for t in threads:
            t.start()
        time.sleep(args.period / 2)
        while time.perf_counter() < stop - args.period / 2:
            prompt = [rng.randrange(1000, 40000) for _ in range(args.long_tokens)]
            t = threading.Thread(target=long_one, args=(prompt,))
            t.start()
            threads.append(t)
            time.sleep(args.period)
        for t in threads:
            t.join()
    row = {"itl_p50_ms": 1e3 * statistics.median(itls), "itl_p99_ms": 1e3 * pct(itls, 0.99),
           "itl_p999_ms": 1e3 * pct(itls, 0.999), "itl_max_ms": 1e3 * max(itls),
           "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p90_ms": 1e3 * pct(ttfts, 0.9),
           "steady_tokens": len(itls) + args.streams, "long_prompts": len(ttfts), "errors": errors[:5],
           "num_errors": len(errors)}  # fmt: skip
    print(f"  {name:10s} ITL p50 {row['itl_p50_ms']:7.1f} ms  p99 {row['itl_p99_ms']:7.1f} ms  p99.9 "
          f"{row['itl_p999_ms']:7.1f} ms  max {row['itl_max_ms']:7.1f} ms   long TTFT p50 "
          f"{row['ttft_p50_ms']:7.1f} ms  p90 {row['ttft_p90_ms']:7.1f} ms   ({row['long_prompts']} long prompts, "
          f"{row['steady_tokens']} steady tokens, {row['num_errors']} errors)", flush=True)  # fmt: skip
    return row


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(doc["ways"])
    panels = ((axes[0], ("itl_p50_ms", "itl_p99_ms", "itl_p999_ms", "itl_max_ms"), "steady streams' ITL (ms, log)"),
              (axes[1], ("ttft_p50_ms", "ttft_p90_ms"), "long prompts' TTFT (ms)"))  # fmt: skip
    for ax, keys, title in panels:
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            ax.bar([i + width * j for i in range(len(names))], [doc["ways"][n][key] for n in names], width,
                   label=key.split("_")[1].replace("p999", "p99.9"))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    chunk = doc["args"].get("max_num_batched_tokens", 2048)
    fig.suptitle(f"P:D vs colocated, same cores, prefill chunks of {chunk} tokens - {doc['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--period", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the engines' step budget: a prompt's prefill chunk (both ways)")
    p.add_argument("--pd-threads", type=int, default=None,
                   help="torch threads of each P:D replica (default: its share of --cores; --cores: both sides "
                        "may use every core, the OS sharing them)")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads of the prefill replica alone (disaggregation.prefill_torch_threads; default: "
                        "as --pd-threads): it shares the decode replica's core while it prefills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks/results/pd")
    p.add_argument("--replot", action="store_true", help="plot --out-dir's JSON of this chunk size again, run nothing")
    args = p.parse_args()
    out = Path(args.out_dir)
    name = "pd_served" + ("" if args.max_num_batched_tokens == 2048 else f"_chunk{args.max_num_batched_tokens}") + \
        ("" if args.pd_threads is None else f"_threads{args.pd_threads}") + \
        ("" if args.prefill_threads is None else f"_prefill{args.prefill_threads}")
    if args.replot:
        plot(json.loads((out / f"{name}.json").read_text()), out / f"{name}.png")
        return 0
    base = {"served_model_name": MODEL, "node_tuning": "off", "dtype": args.dtype, "device": "cpu",
            "max_model_len": 4096, "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    half = max(1, args.cores // 2)
    ways = {"colocated": dict(base, num_replicas=1, worker_num_cpus=args.cores, worker_torch_threads=args.cores),
            "P:D 1:1": dict(base, worker_num_cpus=half, worker_torch_threads=args.pd_threads or half,
                            kv_offloading_size=1.0, disaggregation={"prefill_replicas": 1, "decode_replicas": 1,
                                                                    "prefill_torch_threads": args.prefill_threads})}
    doc: dict[str, Any] = {"cpu": cpu_model(), "args": vars(args), "ways": {}}
    for way, app in ways.items():
        doc["ways"][way] = run_way(way, app, args)
    c, d = doc["ways"]["colocated"], doc["ways"]["P:D 1:1"]
    doc["itl_p99_ratio"] = d["itl_p99_ms"] / c["itl_p99_ms"]
    doc["itl_p999_ratio"] = d["itl_p999_ms"] / c["itl_p999_ms"]
    doc["ttft_p50_ratio"] = d["ttft_p50_ms"] / c["ttft_p50_ms"]
    print(f"P:D / colocated: ITL p99 {doc['itl_p99_ratio']:.2f}x (p99.9 {doc['itl_p999_ratio']:.2f}x), long-prompt "
          f"TTFT p50 {doc['ttft_p50_ratio']:.2f}x "
          f"({doc['cpu']}, {args.cores} cores)")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
