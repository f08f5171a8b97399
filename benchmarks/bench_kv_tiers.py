"""KV tiers on an agent-like workload: conversations of several turns (a shared system prompt and tool list, a long
context of each conversation's own such as a retrieved document or a tool's output, a growing history: the reply of
each turn and the next message appended), whose working set is several times the KV pool, run by the offline engine
over the bundled model on this CPU, five ways: without tiers, with a RAM tier, with a bfloat16 and an int8 RAM tier
(lossy: their greedy tokens' agreement with the others' is reported, and the KL divergence of the first reply token's
distribution from the lossless one's, over its 20 likeliest tokens), with a RAM and a disk tier; then the
disk tier's engine is restarted (a new engine over the same folder, an empty pool and RAM tier) and every
conversation runs one more turn.

Each turn runs every conversation's next request, --concurrency at a time (an agent waits for its reply, and for its
tools, before the next turn). Reported per way and turn: TTFT median and p90 (from the engine's own clock: arrival
to first token), the tiers' hit tokens, the wall time of the turn and its output tokens per second; then the ratios
the KV-tiers goals ask for (TTFT p50 from turn 2 on, without tiers over with, and the restarted engine's first
turn), and a burst of unique prompts (no hit anywhere) with and without tiers: the tiers' cost where they cannot
help. Prompts are random token ids: timing is honest, the text meaningless. Writes ``kv_tiers.json`` and
``kv_tiers.png`` to --out-dir.

    .venv/bin/python benchmarks/bench_kv_tiers.py                 # 12 conversations x 4 turns, ~6 min on 2 cores
    .venv/bin/python benchmarks/bench_kv_tiers.py --quick         # smoke run, ~30 s
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import describe  # noqa: E402

from cbserve import LLM  # noqa: E402
from cbserve.scheduler.requests.request import EngineRequest  # noqa: E402
from cbserve.scheduler.requests.sampling_params import SamplingParams  # noqa: E402
from cbserve.worker.cpu import native  # noqa: E402

GIB = 2**30


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def run_turn(llm: LLM, prompts: list[list[int]], reply: int, tag: str,
             concurrency: int) -> tuple[list[list[int]], dict[str, Any]]:
    """The prompts through the engine's own loop, ``concurrency`` at a time; their replies and the turn's figures."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
    replies: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    ttfts: list[float] = []
    offload = engine.scheduler.offload
    hits0 = offload.stats.hit_tokens_ram if offload is not None else 0
    start = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        for i in range(first, min(first + concurrency, len(prompts))):
            engine.add_request(EngineRequest(f"{tag}-{i}", list(prompts[i]), params))
        while engine.has_unfinished_requests():
            result = engine.step_with_batch_queue()
            if result is None:
                continue
            ttfts += result.iteration_stats.ttfts
            for out in result.outputs:
                replies[out.req_id].extend(out.new_token_ids)
    wall = time.perf_counter() - start
    hits = (offload.stats.hit_tokens_ram if offload is not None else 0) - hits0
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    return [replies[f"{tag}-{i}"] for i in range(len(prompts))], {
        "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * q[8], "tier_hit_tokens": hits,
        "prompt_tokens": sum(map(len, prompts)), "wall_s": wall, "out_tok_s": len(prompts) * reply / wall}


def conversations(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's first prompt (system + tools + its first message), and its later user messages."""
    rng = random.Random(args.seed)
    shared = _ids(rng, args.system_tokens)  # the system prompt and tool list every conversation starts with
    first = [shared + _ids(rng, args.context_tokens + args.message_tokens) for _ in range(args.conversations)]
    later = [[_ids(rng, args.message_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]
    return first, later


def run_way(name: str, fields: dict[str, Any], args: argparse.Namespace, restart: bool = False) -> dict[str, Any]:
    first, later = conversations(args)
    llm = LLM(args.model, progress=False, **fields)
    histories = [list(p) for p in first]
    turns, all_replies = [], []
    for t in range(args.turns):
        prompts = histories if t == 0 else [h + later[c][t] for c, h in enumerate(histories)]
        replies, row = run_turn(llm, prompts, args.reply_tokens, f"{name}-{t}", args.concurrency)
        histories = [p + r for p, r in zip(prompts, replies, strict=True)]
        turns.append(row)
        all_replies.append(replies)
        print(f"  {name:10s} turn {t + 1}: TTFT p50 {row['ttft_p50_ms']:8.1f} ms  p90 {row['ttft_p90_ms']:8.1f} ms  "
              f"tier hits {row['tier_hit_tokens']:6d} / {row['prompt_tokens']} prompt tokens  "
              f"{row['out_tok_s']:6.1f} out tok/s", flush=True)
    out: dict[str, Any] = {"turns": turns, "replies": all_replies}
    if llm.engine.scheduler.offload is not None:
        out["tier_stats"] = vars(llm.engine.scheduler.offload.stats).copy()
    llm.shutdown()
    if restart:  # a new engine over the same disk folder: its pool and RAM tier empty
        llm = LLM(args.model, progress=False, **fields)
        prompts = [h + later[c][-1] for c, h in enumerate(histories)]
        _, row = run_turn(llm, prompts, args.reply_tokens, f"{name}-restart", args.concurrency)
        print(f"  {name:10s} restarted: TTFT p50 {row['ttft_p50_ms']:8.1f} ms  tier hits {row['tier_hit_tokens']}")
        out["restart"] = row
        out["restart"]["hit_tokens_disk"] = llm.engine.scheduler.offload.stats.hit_tokens_disk
        llm.shutdown()
    return out


def no_hit_burst(fields: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Unique prompts (no prefix anywhere): what the tiers cost where they cannot help."""
    rng = random.Random(args.seed + 1)
    prompts = [_ids(rng, args.system_tokens) for _ in range(args.conversations * 2)]
    llm = LLM(args.model, progress=False, **fields)
    run_turn(llm, prompts[:4], 4, "warm", 4)
    _, row = run_turn(llm, prompts, args.reply_tokens, "nohit", len(prompts))  # a burst: steps full of prefill
    llm.shutdown()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512, help="the shared system prompt and tool list")
    p.add_argument("--context-tokens", type=int, default=1024, help="each conversation's own context (a document)")
    p.add_argument("--message-tokens", type=int, default=96, help="each user message (or tool result)")
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=1, help="requests of a turn in flight at once")
    p.add_argument("--pool-tokens", type=int, default=3584, help="the KV pool, in tokens")
    p.add_argument("--ram-gib", type=float, default=2.0, help="the RAM tier")
    p.add_argument("--disk-gib", type=float, default=4.0, help="the disk tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 conversations x 2 turns, a small pool")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    if args.quick:
        args.conversations, args.turns, args.system_tokens, args.message_tokens = 4, 2, 128, 64
        args.context_tokens, args.reply_tokens, args.pool_tokens = 256, 8, 1024
    probe = LLM(args.model, progress=False, max_model_len=4096)
    block_bytes = probe.executor.runner.block_bytes() // probe.config.block_size  # per token
    probe.shutdown()
    base = dict(max_model_len=args.pool_tokens, max_num_seqs=args.conversations,
                kv_cache_memory_bytes=args.pool_tokens * block_bytes)
    working_set = args.conversations * (args.context_tokens + args.turns * (args.message_tokens + args.reply_tokens))
    working_set += args.system_tokens  # shared by all
    cpu = describe(native.supported_levels()[0])
    print(f"KV tiers benchmark on {cpu}: {args.conversations} conversations x {args.turns} turns, working set "
          f"~{working_set} tokens, pool {args.pool_tokens} tokens ({working_set / args.pool_tokens:.1f}x)")
    disk = Path(tempfile.mkdtemp(prefix="cbserve-kv-tiers-"))
    try:
        ways = {"no tiers": run_way("no tiers", base, args),
                "RAM tier": run_way("RAM tier", dict(base, kv_offloading_size=args.ram_gib), args),
                "RAM bf16": run_way("RAM bf16", dict(base, kv_offloading_size=args.ram_gib,
                                                     kv_offloading_dtype="bfloat16"), args),
                "RAM int8": run_way("RAM int8", dict(base, kv_offloading_size=args.ram_gib,
                                                     kv_offloading_dtype="int8"), args),
                "RAM+disk": run_way("RAM+disk", dict(base, kv_offloading_size=args.ram_gib, kv_disk_path=str(disk),
                                                     kv_disk_size=args.disk_gib), args, restart=True)}  # fmt: skip
        nohit = {"no tiers": no_hit_burst(base, args),
                 "RAM tier": no_hit_burst(dict(base, kv_offloading_size=args.ram_gib), args)}
        kl = {dtype: first_token_kl(dict(base, kv_offloading_size=args.ram_gib), dtype, args)
              for dtype in ("bfloat16", "int8")}
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    doc = report(ways, nohit, args, cpu, working_set) | {"first_token_kl": kl}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kv_tiers.json").write_text(json.dumps(doc, indent=2))
    plot(doc, args.out_dir / "kv_tiers.png")
    print(f"wrote {args.out_dir / 'kv_tiers.json'} and kv_tiers.png")
    return 0


def first_token_kl(fields: dict[str, Any], dtype: str, args: argparse.Namespace) -> dict[str, float]:
    """KL(lossless || compressed) of the first reply token's distribution, over the lossless run's 20 likeliest tokens
    (renormalized; a token the compressed run's top 20 lacks gets its 20th logprob), for each conversation's second
    turn restored from the RAM tier: the mean and the largest."""
    import math

    first, later = conversations(args)
    prompts = [p + later[c][1] for c, p in enumerate(first)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    tops = []
    for tier_dtype in ("auto", dtype):
        llm = LLM(args.model, progress=False, **fields, kv_offloading_dtype=tier_dtype)
        run_turn(llm, first, 1, f"kl-{tier_dtype}", 1)  # turn 1 fills the tier; the pool evicts it
        outs = llm.generate(prompts, params, use_tqdm=False)
        tops.append([dict(o.outputs[0].logprobs[0].top) for o in outs])
        llm.shutdown()
    kls = []
    for ref, got in zip(*tops, strict=True):
        floor = min(got.values())
        q = {t: got.get(t, floor) for t in ref}  # both renormalized over the lossless run's top 20
        zp, zq = (math.log(sum(math.exp(v) for v in d.values())) for d in (ref, q))
        kls.append(sum(math.exp(v - zp) * ((v - zp) - (q[t] - zq)) for t, v in ref.items()))
    return {"mean": statistics.fmean(kls), "max": max(kls)}


def agreement(ways: dict[str, Any], way: str) -> float:
    """The share of greedy reply tokens equal to the no-tiers run's, position by position (a history that diverged
    keeps diverging: later turns see different prompts)."""
    pairs = [(a, b) for got, ref in zip(ways[way].pop("replies"), ways["no tiers"]["replies"], strict=True)
             for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def report(ways: dict[str, Any], nohit: dict[str, Any], args: argparse.Namespace, cpu: str,
           working_set: int) -> dict[str, Any]:
    def later_p50(way: str) -> float:
        return statistics.median(t["ttft_p50_ms"] for t in ways[way]["turns"][1:])

    agree = {way: agreement(ways, way) for way in ways if way != "no tiers"}
    ways["no tiers"].pop("replies")

    ratios = {"ttft_p50_turn2plus_none_over_ram": later_p50("no tiers") / later_p50("RAM tier"),
              "ttft_p50_turn2plus_none_over_disk": later_p50("no tiers") / later_p50("RAM+disk"),
              "ttft_p50_turn2plus_none_over_ram_bf16": later_p50("no tiers") / later_p50("RAM bf16"),
              "ttft_p50_turn2plus_none_over_ram_int8": later_p50("no tiers") / later_p50("RAM int8"),
              "restart_ttft_p50_none_over_disk": later_p50("no tiers") / ways["RAM+disk"]["restart"]["ttft_p50_ms"],
              "nohit_throughput_tiers_over_none": nohit["RAM tier"]["out_tok_s"] / nohit["no tiers"]["out_tok_s"]}
    ratios |= {f"greedy_agreement_{way.replace(' ', '_').replace('+', '_').lower()}": a for way, a in agree.items()}
    goals = {"ttft_p50_turn2plus_none_over_ram": 5.0, "restart_ttft_p50_none_over_disk": 5.0,
             "nohit_throughput_tiers_over_none": 0.95, "greedy_agreement_ram_tier": 1.0,
             "greedy_agreement_ram_disk": 1.0}
    print("\nratios (goal)")
    for k, v in ratios.items():
        goal = goals.get(k)
        print(f"  {k:40s} {v:6.2f}" + (f"  (>= {goal}: {'met' if v >= goal else 'NOT met'})" if goal else ""))
    kept = {k: str(v) for k, v in vars(args).items() if k != "out_dir"}  # no path of this machine in the record
    return {"cpu": cpu, "args": kept, "working_set_tokens": working_set,
            "ways": ways, "no_hit_burst": nohit, "ratios": ratios,
            "goals": {k: {"goal": g, "value": ratios[k], "met": ratios[k] >= g} for k, g in goals.items()}}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for way, res in doc["ways"].items():
        ys = [t["ttft_p50_ms"] for t in res["turns"]]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=way)
    restart = doc["ways"]["RAM+disk"].get("restart")
    if restart:
        ax.scatter([len(doc["ways"]["RAM+disk"]["turns"]) + 1], [restart["ttft_p50_ms"]], marker="*", s=120,
                   color="black", label="RAM+disk, restarted engine", zorder=3)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_title(f"KV tiers, {doc['working_set_tokens']} working-set tokens\n{doc['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
