"""Speculative decoding benchmark, served: ``cbserve serve`` once without and once with ``speculative_config``
(back to back, each its own local Ray instance), the same client workloads against each.

Workloads (the served counterpart of bench_spec.py; greedy; the same seeds give the same requests):

- ``grounded``: bench_spec.py's prompts ("Rewrite the following text exactly: <3-5 sentences>") through the
  chat endpoint, up to ``--max-tokens`` (128) tokens, stopping at EOS (``--grounded-ignore-eos`` to force
  the full length);
- ``burst``: random-word prompts of 16-128 tokens (one token per word, cbserve.bench.datasets) through the
  completions endpoint, output lengths drawn from ``--burst-outputs`` (32 64 128), ignore_eos.

At concurrency 1, ``--repeats`` requests go one after another; at c > 1, c requests are sent at once.
Reported per workload and concurrency, without ("off") and with ("spec") speculation: output tok/s (all
output tokens / run time), median TPOT ((latency - TTFT) / (tokens - 1), per request) and TTFT, the draft
acceptance rate (the replicas' ``spec_num_accepted_tokens / spec_num_draft_tokens`` from ``GET /stats``,
delta over the run), the TPOT speed-up (off / spec) and throughput ratio (spec / off), and whether the
streamed texts with and without speculation are identical (``same``). The goal of issue 20: >= 1.8x lower
TPOT at one request on the grounded workload with n-gram, no loss over 5% on the burst.

With speculation the engine runs without async scheduling (they do not combine yet); the baseline keeps
the server's default unless ``--sync-baseline``. ``--draft-model PATH`` speculates with a draft model
(method "draft_model", same tokenizer; e.g. one made by make_truncated_draft.py) instead of n-gram.

    .venv/bin/python benchmarks/bench_spec_serving.py                         # full run
    .venv/bin/python benchmarks/bench_spec_serving.py --cbserve-args "--dtype bfloat16"
    .venv/bin/python benchmarks/bench_spec_serving.py --draft-model /tmp/smollm2-draft6
    .venv/bin/python benchmarks/bench_spec_serving.py --quick                 # smoke test, ~2 min

Prints a markdown table; writes ``bench_spec_serving.json`` (``bench_spec_serving_draft.json`` with a draft
model) to --out-dir and the servers' logs to --out-dir/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbserve.bench.client import ClientConfig
from cbserve.bench.datasets import SampleRequest, estimate_tokens, random_words
from cbserve.bench.deploy import local_deployment_process
from cbserve.bench.runner import LoadConfig, run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import grounded_prompt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "spec")
COUNTERS = ("spec_num_draft_tokens", "spec_num_accepted_tokens")


@dataclass(frozen=True)
class Run:
    """One workload at one concurrency: the requests sent to both servers."""

    workload: str
    concurrency: int
    requests: list[SampleRequest]

    @property
    def key(self) -> str:
        return f"{self.workload}@{self.concurrency}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["grounded", "burst"], choices=["grounded", "burst"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3, help="requests run one after another at concurrency 1")
    p.add_argument("--max-tokens", type=int, default=128, help="grounded workload")
    p.add_argument("--grounded-ignore-eos", action="store_true", help="grounded outputs run to --max-tokens")
    p.add_argument("--burst-outputs", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--draft-model", default=None, help='method "draft_model" with this folder instead of n-gram')
    p.add_argument("--cbserve-args", default="", help='extra `cbserve serve` flags, one string ("--dtype bfloat16")')
    p.add_argument("--sync-baseline", action="store_true",
                   help="the baseline server without async scheduling too (as the speculative one runs)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: concurrency 1 (2 requests) and 4, 48 grounded tokens, burst outputs 16 32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--quiet", action="store_true", help="no progress bars (progress lines still printed)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if "--speculative-config" in shlex.split(args.cbserve_args):
        p.error("--cbserve-args must not set --speculative-config: the script sets it (use its own flags)")
    if args.quick:
        args.concurrency, args.repeats, args.max_tokens, args.burst_outputs = [1, 4], 2, 48, [16, 32]
    return args


def spec_config(args: argparse.Namespace) -> dict[str, Any]:
    k = args.num_speculative_tokens
    if args.draft_model is not None:
        spec: dict[str, Any] = {"method": "draft_model", "model": str(Path(args.draft_model).resolve()),
                                "num_speculative_tokens": k}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    return spec


def build_runs(args: argparse.Namespace) -> list[Run]:
    """The requests of every (workload, concurrency); seeded as bench_spec.py (seed * 1000 + concurrency)."""
    runs = []
    for workload in args.workloads:
        for conc in args.concurrency:
            rng = random.Random(args.seed * 1000 + conc)
            n = args.repeats if conc == 1 else conc
            reqs = []
            for _ in range(n):
                if workload == "grounded":
                    prompt = grounded_prompt(rng)
                    reqs.append(SampleRequest(prompt, estimate_tokens(prompt), args.max_tokens))
                else:
                    n_in = rng.randint(16, 128)
                    reqs.append(SampleRequest(random_words(rng, n_in), n_in, rng.choice(args.burst_outputs)))
            runs.append(Run(workload, conc, reqs))
    return runs


def client_for(base_url: str, workload: str, args: argparse.Namespace) -> ClientConfig:
    if workload == "grounded":
        return ClientConfig(base_url=base_url, model="", endpoint="chat", ignore_eos=args.grounded_ignore_eos)
    return ClientConfig(base_url=base_url, model="", endpoint="completions", ignore_eos=True)


def spec_totals(base_url: str) -> dict[str, int]:
    """The replicas' speculative-decoding counters from ``GET /stats``, summed."""
    with urllib.request.urlopen(base_url + "/stats", timeout=60) as r:
        stats = json.loads(r.read())
    return {k: sum(int(rep.get(k) or 0) for rep in stats.get("replicas", [])) for k in COUNTERS}


def measure(base_url: str, run: Run, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Send ``run``'s requests, return its figures (and the streamed texts, to compare between modes)."""
    load = LoadConfig(max_concurrency=1 if run.concurrency == 1 else None, seed=args.seed,
                      request_timeout_s=args.request_timeout, progress=not args.quiet)
    before = spec_totals(base_url)
    doc = run_benchmark(client_for(base_url, run.workload, args), run.requests, load,
                        label=f"{mode} {run.key}", include_text=True)
    after = spec_totals(base_url)
    s = doc["summary"]
    drafted, accepted = (after[k] - before[k] for k in COUNTERS)
    res = {
        "completed": s["completed"], "failed": s["failed"], "duration_s": s["duration_s"],
        "output_tokens": s["total_output_tokens"], "tok_s": s["output_throughput"],
        "median_tpot_ms": s["median_tpot_ms"], "mean_tpot_ms": s["mean_tpot_ms"],
        "median_ttft_ms": s["median_ttft_ms"], "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "errors": [q["error"] for q in doc["requests"] if q["error"]][:5],
        "texts": [q["generated_text"] for q in doc["requests"]],
    }  # fmt: skip
    rate = "-" if res["acceptance_rate"] is None else f"{100 * res['acceptance_rate']:.0f}%"
    print(f"[{mode}] {run.workload} c={run.concurrency}: {s['completed']}/{len(run.requests)} ok, "
          f"{res['tok_s']:.1f} tok/s, median TPOT {res['median_tpot_ms']:.1f} ms, median TTFT "
          f"{res['median_ttft_ms']:.0f} ms, acceptance {rate}", flush=True)
    return res


def serve_mode(mode: str, spec: dict[str, Any], runs: list[Run], args: argparse.Namespace) -> dict[str, Any]:
    """Start ``cbserve serve`` (with ``spec`` when ``mode`` is "spec"), warm it up, measure every run."""
    app_args: dict[str, Any] = {}
    if mode == "spec":
        app_args["speculative_config"] = json.dumps(spec)
    elif args.sync_baseline:
        app_args["async_scheduling"] = False
    log = args.out_dir / "logs" / f"spec_serving_{mode}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    what = f" speculative_config={json.dumps(spec)}" if mode == "spec" else ""
    print(f"[{mode}] starting: cbserve serve {args.cbserve_args}{what} (log {log})", flush=True)
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    with local_deployment_process(app_args, args.ready_timeout, log, shlex.split(args.cbserve_args)) as (url, _):
        print(f"[{mode}] ready in {time.perf_counter() - t0:.0f} s", flush=True)
        warm = [SampleRequest("Rewrite the following text exactly:\n\nHello there.", 12, 8)]
        run_benchmark(client_for(url, "grounded", args), warm, LoadConfig(progress=False), label="warm-up")
        for run in runs:
            out[run.key] = measure(url, run, mode, args)
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def make_rows(runs: list[Run], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        off, on = results["off"][run.key], results["spec"][run.key]
        differ = sum(a != b for a, b in zip(off["texts"], on["texts"], strict=True))
        rows.append({
            "workload": run.workload, "concurrency": run.concurrency, "requests": len(run.requests),
            "off": {k: v for k, v in off.items() if k != "texts"},
            "spec": {k: v for k, v in on.items() if k != "texts"},
            "tpot_speedup": _ratio(off["median_tpot_ms"], on["median_tpot_ms"]),
            "throughput_ratio": _ratio(on["tok_s"], off["tok_s"]),
            "num_different_outputs": differ,
            "same_outputs": differ == 0 and off["failed"] == 0 and on["failed"] == 0,
        })  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | c | tok/s off | tok/s spec | TPOT off (ms) | TPOT spec (ms) | TTFT off (ms) | TTFT spec (ms) "
        "| TPOT speed-up | tok/s ratio | acceptance | same |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        off, on = r["off"], r["spec"]
        rate = "-" if on["acceptance_rate"] is None else f"{100 * on['acceptance_rate']:.0f}%"
        speed = "-" if r["tpot_speedup"] is None else f"{r['tpot_speedup']:.2f}x"
        tput = "-" if r["throughput_ratio"] is None else f"{r['throughput_ratio']:.2f}x"
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {off['tok_s']:.1f} | {on['tok_s']:.1f} | "
            f"{off['median_tpot_ms']:.1f} | {on['median_tpot_ms']:.1f} | {off['median_ttft_ms']:.0f} | "
            f"{on['median_ttft_ms']:.0f} | {speed} | {tput} | {rate} | {'yes' if r['same_outputs'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from cbserve.bench.report import cpu_model, git_commit

    args = parse_args(argv)
    spec = spec_config(args)
    runs = build_runs(args)
    results = {mode: serve_mode(mode, spec, runs, args) for mode in MODES}
    rows = make_rows(runs, results)
    meta = {
        "speculative_config": spec, "cbserve_args": args.cbserve_args, "sync_baseline": args.sync_baseline,
        "args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_model(), "cores": os.cpu_count(),
        "commit": git_commit(ROOT), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / ("bench_spec_serving_draft.json" if args.draft_model else "bench_spec_serving.json")
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(format_table(rows))
    print(f"wrote {out}")
    failed = sum(r[m]["failed"] for r in rows for m in MODES)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
