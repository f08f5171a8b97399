"""Speculative decoding (n-gram prompt lookup) benchmark, offline (``cbserve.LLM`` in process).

Two workloads, each at several concurrencies (that many requests submitted at once; at 1, ``--repeats``
requests one after another), each with and without ``speculative_config``:

- ``grounded``: outputs that copy spans of their prompts: chat prompts "Rewrite the following text
  exactly: <text>", the texts made of random sentences of a fixed pool (greedy, up to ``--max-tokens``);
- ``burst``: the random burst of bench_cpu.py: random-token prompts of 16-128 tokens, output lengths drawn
  from ``--burst-outputs``, ignore_eos (n-gram lookup rarely finds anything: the cost of trying).

Reported per run: output tok/s (all output tokens / wall time), mean TPOT (per request: time from its first
to its last token / (tokens - 1)), draft acceptance rate, and, with speculation, the speedup of TPOT and
throughput over the same run without it. Greedy outputs with and without speculation are compared token
for token (``same_tokens``).

    python benchmarks/bench_spec.py                                  # ~5 min on 2 cores
    python benchmarks/bench_spec.py --concurrency 1 --repeats 1     # smoke test
    python benchmarks/bench_spec.py --draft-model PATH               # a draft model instead of n-gram
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

SENTENCES = [
    "The committee approved the new budget after a long debate about road maintenance.",
    "Our office will be closed on Monday for the national holiday.",
    "Please send the signed contract to the legal department before Friday.",
    "The river flooded the lower fields twice this spring, ruining the early crops.",
    "She finished the marathon in just under four hours, a personal best.",
    "The library now lends laptops to students for up to two weeks.",
    "Remember to water the tomatoes every evening while I am away.",
    "The train to the airport leaves every twenty minutes from platform three.",
    "Our new recipe uses less sugar and more cinnamon than the original.",
    "The museum's east wing reopens next month after a year of repairs.",
    "Backups run every night at two, and the logs are kept for ninety days.",
    "The team fixed the login bug and shipped the update on Tuesday.",
    "Heavy snow is expected in the mountains, so check the roads before leaving.",
    "The concert was moved indoors because of the forecast of thunderstorms.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["grounded", "burst"], choices=["grounded", "burst"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3, help="requests run one after another at concurrency 1")
    p.add_argument("--max-tokens", type=int, default=128, help="grounded workload")
    p.add_argument("--burst-outputs", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config's disable_by_batch_size (no drafts while more sequences run)")
    p.add_argument("--draft-model", default=None,
                   help='speculate with this draft model (method "draft_model", same tokenizer) instead of n-gram; '
                        'the "ngram" columns then hold its results')
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    return p.parse_args()


def grounded_prompt(rng: random.Random) -> str:
    """One grounded user message: "Rewrite the following text exactly:" and 3-5 sentences of the pool."""
    text = " ".join(rng.sample(SENTENCES, rng.randint(3, 5)))
    return f"Rewrite the following text exactly:\n\n{text}"


def grounded_requests(n: int, rng: random.Random, max_tokens: int) -> list[tuple[Any, Any]]:
    from cbserve import SamplingParams

    out = []
    for _ in range(n):
        msgs = [{"role": "user", "content": grounded_prompt(rng)}]
        out.append((msgs, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    return out


def burst_requests(n: int, rng: random.Random, outputs: list[int], vocab: int) -> list[tuple[Any, Any]]:
    from cbserve import SamplingParams

    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))]
        sp = SamplingParams(temperature=0.0, max_tokens=rng.choice(outputs), ignore_eos=True)
        out.append((prompt, sp))
    return out


def encode(llm: Any, prompt: Any) -> list[int]:
    from cbserve.frontend.text.tokenizer import apply_chat_template

    return list(prompt) if prompt and isinstance(prompt[0], int) else apply_chat_template(llm.tokenizer, prompt)


def run_batch(llm: Any, batch: list[tuple[list[int], Any]], tag: str) -> dict[str, Any]:
    """Submit ``batch`` at once and step the engine until done; per-request TPOT from the engine's times."""
    engine = llm.engine
    req_ids = [f"{tag}-{i}" for i in range(len(batch))]
    for rid, (ids, sp) in zip(req_ids, batch, strict=True):
        engine.add_request(llm.processor.add_request(rid, ids, sp))
    tokens: dict[str, list[int]] = {r: [] for r in req_ids}
    tpots: list[float] = []
    num_tokens = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        res = engine.step()
        for out in res.outputs:
            tokens[out.req_id].extend(out.new_token_ids)
        for fin in res.iteration_stats.finished:
            num_tokens += fin.times.num_generation_tokens
            if fin.times.tpot is not None:
                tpots.append(fin.times.tpot)
    seconds = time.perf_counter() - t0
    for rid in req_ids:
        llm.processor.pop(rid)
    return {"seconds": seconds, "tokens": num_tokens, "tpots": tpots, "outputs": [tokens[r] for r in req_ids]}


def run(llm: Any, requests: list[tuple[list[int], Any]], concurrency: int, tag: str) -> dict[str, Any]:
    totals = llm.engine.totals
    drafted, accepted = totals.spec_num_draft_tokens, totals.spec_num_accepted_tokens
    batches = [requests[i : i + concurrency] for i in range(0, len(requests), concurrency)]
    parts = [run_batch(llm, b, f"{tag}-{j}") for j, b in enumerate(batches)]
    seconds = sum(p["seconds"] for p in parts)
    num_tokens = sum(p["tokens"] for p in parts)
    tpots = [t for p in parts for t in p["tpots"]]
    drafted = totals.spec_num_draft_tokens - drafted
    accepted = totals.spec_num_accepted_tokens - accepted
    return {
        "seconds": seconds,
        "output_tokens": num_tokens,
        "tok_s": num_tokens / seconds,
        "tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "outputs": [o for p in parts for o in p["outputs"]],
    }


def main() -> int:
    from cbserve import LLM, SamplingParams

    args = parse_args()
    spec = {
        "method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
    }  # fmt: skip
    if args.draft_model is not None:
        k = args.num_speculative_tokens
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    common = {"max_num_batched_tokens": args.max_num_batched_tokens, "enable_prefix_caching": False,
              "progress": False}  # fmt: skip
    llms = {"off": LLM(**common), "ngram": LLM(speculative_config=spec, **common)}
    for llm in llms.values():  # warm-up
        run(llm, [([1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=8))], 1, "w")
    vocab = len(llms["off"].tokenizer)
    rows = []
    for workload in args.workloads:
        for conc in args.concurrency:
            rng = random.Random(args.seed * 1000 + conc)
            n = args.repeats if conc == 1 else conc
            if workload == "grounded":
                reqs = grounded_requests(n, rng, args.max_tokens)
            else:
                reqs = burst_requests(n, rng, args.burst_outputs, vocab)
            encoded = [(encode(llms["off"], p), sp) for p, sp in reqs]
            res = {mode: run(llm, encoded, conc, f"{workload}{conc}{mode}") for mode, llm in llms.items()}
            off, on = res["off"], res["ngram"]
            row = {
                "workload": workload, "concurrency": conc, "requests": n,
                "off": {k: v for k, v in off.items() if k != "outputs"},
                "ngram": {k: v for k, v in on.items() if k != "outputs"},
                "tpot_speedup": (off["tpot_ms"] / on["tpot_ms"]) if off["tpot_ms"] and on["tpot_ms"] else None,
                "throughput_ratio": on["tok_s"] / off["tok_s"],
                "same_tokens": off["outputs"] == on["outputs"],
            }  # fmt: skip
            rows.append(row)
            print(format_row(row), flush=True)
    for llm in llms.values():
        llm.shutdown()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"speculative_config": spec, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out_dir / "bench_spec.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out_dir / 'bench_spec.json'}")
    return 0


def format_row(r: dict[str, Any]) -> str:
    off, on = r["off"], r["ngram"]
    rate = "-" if on["acceptance_rate"] is None else f"{100 * on['acceptance_rate']:.0f}%"
    tpot = "-" if r["tpot_speedup"] is None else f"{r['tpot_speedup']:.2f}x"
    return (
        f"| {r['workload']} | {r['concurrency']} | {off['tok_s']:.1f} | {on['tok_s']:.1f} | "
        f"{off['tpot_ms'] or 0:.1f} | {on['tpot_ms'] or 0:.1f} | {tpot} | {r['throughput_ratio']:.2f}x | {rate} | "
        f"{'yes' if r['same_tokens'] else 'NO'} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
