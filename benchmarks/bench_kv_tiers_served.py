"""KV tiers served, on 1 and 2 engine replicas: ``bench_kv_tiers.py``'s agent-like conversations (a shared system
prompt and tool list, a long context of each conversation's own, a growing history; the working set several times a
replica's pool) sent to ``cbserve serve`` over HTTP (streamed completions of token-id prompts, --concurrency at a time,
the cache-aware router placing them), four ways on the same cores: one replica (2 worker threads) and two (1 each),
each without tiers and with a RAM tier and a disk tier (the two replicas share the disk folder); then the two-replica
tiered app is stopped and started again over the same folder (a warm restart: empty pools and RAM tiers) for one more
turn. Reported per way and turn: client TTFT p50 and p90, the prompt tokens served from cache
(``usage.prompt_tokens_details.cached_tokens``: pool and tiers) and output tokens per second. Writes
``kv_tiers_served.json`` and ``.png`` to --out-dir.

    .venv/bin/python benchmarks/bench_kv_tiers_served.py            # ~8 min on 2 cores
    .venv/bin/python benchmarks/bench_kv_tiers_served.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_tiers import conversations  # noqa: E402
from cpu_info import describe  # noqa: E402

from cbserve.bench.deploy import local_deployment  # noqa: E402
from cbserve.worker.cpu import native  # noqa: E402

MODEL_NAME = "smollm2"


def one_request(client: Any, prompt: list[int], reply: int) -> tuple[float, int, list[int]]:
    """TTFT (s), cached prompt tokens and the reply's token ids of one streamed completion."""
    t0 = time.perf_counter()
    ttft, cached, tokens = None, 0, []
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=reply, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": False})  # fmt: skip
    for chunk in stream:
        if chunk.choices and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
        for c in chunk.choices:
            tokens += (c.model_extra or {}).get("token_ids") or []
    return ttft or 0.0, cached, tokens


def run_turn(client: Any, prompts: list[list[int]], reply: int, concurrency: int) -> dict[str, Any]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(client, p, reply), prompts))
    wall = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * q[8],
            "cached_tokens": sum(r[1] for r in results), "prompt_tokens": sum(map(len, prompts)),
            "wall_s": wall, "out_tok_s": len(prompts) * reply / wall}  # fmt: skip


def serve_args(args: argparse.Namespace, replicas: int, tiers: bool, disk: Path) -> dict[str, Any]:
    out = {"served_model_name": MODEL_NAME, "num_replicas": replicas, "worker_num_cpus": 2 // replicas,
           "worker_torch_threads": 2 // replicas, "num_kv_blocks": args.pool_tokens // 16,
           "max_model_len": args.pool_tokens, "node_tuning": "off", "dtype": "float32", "device": "cpu"}  # fmt: skip
    if tiers:
        out |= {"kv_offloading_size": args.ram_gib, "kv_disk_path": str(disk), "kv_disk_size": args.disk_gib}
    return out


def run_way(name: str, app: dict[str, Any], args: argparse.Namespace, restart: bool = False) -> dict[str, Any]:
    import openai

    first, later = conversations(args)
    histories = [list(p) for p in first]
    out: dict[str, Any] = {"app": {k: v for k, v in app.items() if k != "kv_disk_path"}, "turns": []}
    reply = [1000 + i for i in range(args.reply_tokens)]  # a fixed reply appended: the histories match across ways
    with local_deployment(app, timeout_s=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        for t in range(args.turns):
            prompts = histories if t == 0 else [h + later[c][t] for c, h in enumerate(histories)]
            row = run_turn(client, prompts, args.reply_tokens, args.concurrency)
            histories = [p + reply for p in prompts]
            out["turns"].append(row)
            print(f"  {name:22s} turn {t + 1}: TTFT p50 {row['ttft_p50_ms']:8.1f} ms  p90 {row['ttft_p90_ms']:8.1f} ms"
                  f"  cached {row['cached_tokens']:6d} / {row['prompt_tokens']}  {row['out_tok_s']:6.1f} out tok/s",
                  flush=True)  # fmt: skip
    if restart:  # the same app and disk folder, started again: empty pools and RAM tiers
        with local_deployment(app, timeout_s=600) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
            prompts = [h + later[c][-1] for c, h in enumerate(histories)]
            out["restart"] = row = run_turn(client, prompts, args.reply_tokens, args.concurrency)
            print(f"  {name:22s} restarted: TTFT p50 {row['ttft_p50_ms']:8.1f} ms  cached {row['cached_tokens']}")
    return out


def ratio(ways: dict[str, Any], base: str, tiered: str) -> float:
    """TTFT p50 from turn 2 on (the median of the turns' p50s), without tiers over with."""
    p50 = {w: statistics.median(t["ttft_p50_ms"] for t in ways[w]["turns"][1:]) for w in (base, tiered)}
    return p50[base] / p50[tiered]


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, way in doc["ways"].items():
        ys = [t["ttft_p50_ms"] for t in way["turns"]] + ([way["restart"]["ttft_p50_ms"]] if "restart" in way else [])
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set_xticks(range(1, 2 + max(len(w["turns"]) for w in doc["ways"].values())))
    ax.set_xlabel("turn (the last of the 2-replica tiered app: after a warm restart)")
    ax.set_ylabel("TTFT p50 (ms, client)")
    ax.set_yscale("log")
    ax.set_title(f"KV tiers served, 1 and 2 replicas - {doc['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--message-tokens", type=int, default=96)
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=2, help="requests of a turn in flight at once")
    p.add_argument("--pool-tokens", type=int, default=3584, help="each replica's KV pool, in tokens")
    p.add_argument("--ram-gib", type=float, default=1.0, help="each replica's RAM tier")
    p.add_argument("--disk-gib", type=float, default=4.0, help="the disk tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 conversations x 2 turns, short prompts")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results" / "kv_tiers")
    args = p.parse_args()
    if args.quick:
        args.conversations, args.turns, args.context_tokens, args.system_tokens, args.pool_tokens = 4, 2, 256, 256, 1024
    cpu = describe(native.supported_levels()[0])
    print(f"KV tiers served on {cpu}")
    ways: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cbserve-kv-served-") as tmp:
        for replicas in (1, 2):
            for tiers in (False, True):
                name = f"{replicas} replica{'s' * (replicas > 1)}, {'tiers' if tiers else 'no tiers'}"
                disk = Path(tmp) / f"disk-{replicas}"
                app = serve_args(args, replicas, tiers, disk)
                ways[name] = run_way(name, app, args, restart=tiers and replicas == 2)
    names = {r: f"{r} replica{'s' * (r > 1)}" for r in (1, 2)}
    ratios = {names[r]: ratio(ways, f"{names[r]}, no tiers", f"{names[r]}, tiers") for r in (1, 2)}
    kept = {k: v for k, v in vars(args).items() if k != "out_dir"}  # no path of this machine in the record
    doc = {"cpu": cpu, "args": kept, "ways": ways,
           "ttft_p50_from_turn2_no_tiers_over_tiers": ratios}  # fmt: skip
    for k, v in ratios.items():
        print(f"TTFT p50 from turn 2 on, without tiers over with, {k}: {v:.2f}x")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kv_tiers_served.json").write_text(json.dumps(doc, indent=1))
    plot(doc, args.out_dir / "kv_tiers_served.png")
    print(f"wrote {args.out_dir / 'kv_tiers_served.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
