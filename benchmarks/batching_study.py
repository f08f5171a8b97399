"""The batching study, reproduced with the bundled model in one command:

    .venv/bin/python benchmarks/batching_study.py            # ~10-15 min on a 2-core CPU
    .venv/bin/python benchmarks/batching_study.py --scale 0.3   # a quick smoke run

For each batching policy (static, dynamic = time-window static, continuous, continuous with chunked
prefill) it deploys cbserve on a free port and measures
  1. throughput on a burst of requests whose output lengths vary widely (a long tail),
  2. latency CDFs under Poisson arrivals at a low rate and at one near saturation
     (rates set from the continuous policy's burst throughput, so the study adapts to the hardware),
then 3. TTFT on a long shared system prompt with prefix caching on and off.
It writes result JSONs and figures into benchmarks/results/ and a section of BENCHMARKS.md (between
markers, so reruns replace it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cbserve.bench.client import ClientConfig
from cbserve.bench.datasets import SampleRequest, sample_random
from cbserve.bench.deploy import local_deployment
from cbserve.bench.plots import plot_runs
from cbserve.bench.report import git_commit, hardware_summary, markdown_table, replace_section
from cbserve.bench.runner import LoadConfig, run_benchmark, save_result

ROOT = Path(__file__).resolve().parents[1]
SECTION = "batching-study"
MAX_NUM_SEQS = 8
CHUNK_TOKENS = 32  # token budget per iteration with chunked prefill (forces prompts into chunks)
PROMPT_LEN = (16, 64)
SHORT_OUT, LONG_OUT, LONG_FRACTION = (4, 16), (64, 128), 0.25
SHARED_PREFIX = 448
COMMON: dict[str, Any] = {"max_num_seqs": MAX_NUM_SEQS, "max_model_len": 1024, "max_num_batched_tokens": 1024,
                          "enable_prefix_caching": True, "seed": 0}
VARIANTS: dict[str, dict[str, Any]] = {  # run in this order: continuous first calibrates the rates
    # Chunked prefill is not a switch: it happens when a prompt is longer than what is left of the
    # iteration's token budget. With 1024 tokens and prompts of at most 64 + 448, "continuous" never chunks.
    "continuous": {"policy": "continuous"},
    "continuous+chunked": {"policy": "continuous", "max_num_batched_tokens": CHUNK_TOKENS},
    "dynamic": {"policy": "dynamic"},
    "static": {"policy": "static"},
}
PREFIX_VARIANT = "continuous"  # whole prompt in one step: TTFT is prefill


def long_tail_requests(n: int, seed: int) -> list[SampleRequest]:
    """Random prompts; outputs mostly short, a quarter long (a long tail: widely varying lengths)."""
    rng = random.Random(seed + 1)
    reqs = sample_random(n, PROMPT_LEN, (1, 1), seed=seed)
    return [replace(r, output_len=rng.randint(*LONG_OUT) if rng.random() < LONG_FRACTION
                    else rng.randint(*SHORT_OUT)) for r in reqs]


def workloads(scale: float) -> dict[str, dict[str, Any]]:
    n = lambda k: max(4, round(k * scale))  # noqa: E731
    return {
        "burst": {"requests": long_tail_requests(n(24), seed=1)},
        "low": {"requests": long_tail_requests(n(10), seed=2), "utilisation": 0.25},
        "high": {"requests": long_tail_requests(n(24), seed=3), "utilisation": 0.9},
        "prefix": {"requests": sample_random(n(8), (16, 32), (4, 4), shared_prefix_len=SHARED_PREFIX,
                                             seed=4)},
    }


def variant_args(name: str, model: str | None, prefix_caching: bool = True) -> dict[str, Any]:
    args = {**COMMON, **VARIANTS[name], "enable_prefix_caching": prefix_caching}
    if model:
        args["model"] = model
    return filter_known(args)


def filter_known(args: dict[str, Any]) -> dict[str, Any]:
    """Drop keys the deployed CBServeConfig does not (yet) declare, saying so."""
    from cbserve.config import CBServeConfig

    known = set(CBServeConfig.model_fields)
    dropped = sorted(set(args) - known)
    if dropped:
        print(f"[study] note: CBServeConfig has no {dropped}; running without them", flush=True)
    return {k: v for k, v in args.items() if k in known}


class Study:
    def __init__(self, out_dir: Path, scale: float, model: str | None, deploy_timeout_s: float) -> None:
        self.out_dir = out_dir
        self.model = model
        self.deploy_timeout_s = deploy_timeout_s
        self.work = workloads(scale)
        self.results: dict[str, dict[str, Any]] = {}  # "<variant>/<workload>" -> result document
        self.rates: dict[str, float] = {}
        self.notes: list[str] = []
        self.loadavg: list[float] = []  # 1-minute load average at the start and the end

    def warm_up(self, base_url: str) -> None:
        """One short request, so the first measured request does not pay for lazy initialisation."""
        client = ClientConfig(base_url=base_url, model="", temperature=0.0, ignore_eos=True)
        run_benchmark(client, sample_random(1, (8, 8), (4, 4), seed=99), LoadConfig(progress=False))

    def bench(self, base_url: str, variant: str, workload: str, load: LoadConfig) -> dict[str, Any]:
        client = ClientConfig(base_url=base_url, model="", temperature=0.0, ignore_eos=True)
        reqs = self.work[workload]["requests"]
        t0 = time.monotonic()
        res = run_benchmark(client, reqs, load, label=variant,
                            extra_config={"workload": workload, "num_prompts": len(reqs)})
        s = res["summary"]
        print(f"[study] {variant:>20} {workload:>7}: {s['completed']}/{s['num_requests']} ok, "
              f"{s['output_throughput']:.1f} tok/s, {s['request_throughput']:.2f} req/s, "
              f"median TTFT {s['median_ttft_ms']:.0f} ms, median e2e {s['median_e2el_ms']:.0f} ms "
              f"({time.monotonic() - t0:.0f}s)", flush=True)
        if s["failed"]:
            errors = {r["error"] for r in res["requests"] if not r["success"]}
            self.notes.append(f"{variant}/{workload}: {s['failed']} failed requests ({sorted(errors)[:2]})")
        self.results[f"{variant}/{workload}"] = res
        save_result(res, self.out_dir / "json" / f"{variant.replace('+', '_')}_{workload}.json")
        return res

    def run_variant(self, name: str) -> None:
        log = self.out_dir / "logs" / f"{name.replace('+', '_')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with local_deployment(variant_args(name, self.model), self.deploy_timeout_s, log) as url:
            print(f"[study] {name}: deployed in {time.monotonic() - t0:.0f}s at {url}", flush=True)
            self.warm_up(url)
            burst = self.bench(url, name, "burst", LoadConfig(progress=False))
            if not self.rates:
                cap = burst["summary"]["request_throughput"]
                self.rates = {w: self.work[w]["utilisation"] * cap for w in ("low", "high")}
                print(f"[study] capacity {cap:.2f} req/s -> rates {self.rates}", flush=True)
            for w in ("low", "high"):
                self.bench(url, name, w, LoadConfig(request_rate=self.rates[w], seed=7, progress=False))
            if name == PREFIX_VARIANT:
                self.bench(url, "prefix cache on", "prefix", LoadConfig(max_concurrency=1, progress=False))

    def run_prefix_off(self) -> None:
        args = variant_args(PREFIX_VARIANT, self.model, prefix_caching=False)
        with local_deployment(args, self.deploy_timeout_s, self.out_dir / "logs" / "prefix_off.log") as url:
            self.warm_up(url)
            self.bench(url, "prefix cache off", "prefix", LoadConfig(max_concurrency=1, progress=False))

    def run(self, variants: list[str]) -> None:
        self.loadavg.append(os.getloadavg()[0])
        for name in variants:
            self.run_variant(name)
        if PREFIX_VARIANT in variants:
            self.run_prefix_off()
        self.loadavg.append(os.getloadavg()[0])


# ---- report -----------------------------------------------------------------------------------------


def caption(model: str, workload: str) -> str:
    return f"hardware: {hardware_summary()} | model: {model} | workload: {workload} | git {git_commit(ROOT)}"


def write_figures(study: Study, model_name: str) -> dict[str, str]:
    figs: dict[str, str] = {}
    names = [v for v in VARIANTS if f"{v}/burst" in study.results]
    r = study.results
    specs = [
        ("latency_low.png", "cdf", [r[f"{v}/low"] for v in names],
         f"Latency CDFs, Poisson {study.rates.get('low', 0):.2f} req/s (low load)", "low"),
        ("latency_high.png", "cdf", [r[f"{v}/high"] for v in names],
         f"Latency CDFs, Poisson {study.rates.get('high', 0):.2f} req/s (near saturation)", "high"),
        ("throughput_vs_load.png", "throughput",
         [_as_load_point(r[f"{v}/{w}"]) for v in names for w in ("low", "high", "burst")],
         "Throughput and latency versus offered load (burst plotted at its achieved rate)", "low/high/burst"),
        ("prefix_caching.png", "cdf",
         [r[k] for k in ("prefix cache on/prefix", "prefix cache off/prefix") if k in r],
         "Shared 448-token system prompt: prefix caching on vs off (one request at a time)", "prefix"),
    ]
    for fname, kind, runs, title, wl in specs:
        if not runs:
            continue
        path = study.out_dir / fname
        plot_runs(runs, path, kind=kind, title=title, caption=caption(model_name, describe_workload(wl)))
        figs[wl] = str(path.relative_to(ROOT))
    return figs


def _as_load_point(res: dict[str, Any]) -> dict[str, Any]:
    if res["config"]["request_rate"] != "inf":
        return res
    cfg = {**res["config"], "request_rate": res["summary"]["request_throughput"]}
    return {**res, "config": cfg}


def describe_workload(name: str) -> str:
    lens = (f"prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tok, outputs {100 - 100 * LONG_FRACTION:.0f}% "
            f"{SHORT_OUT[0]}-{SHORT_OUT[1]} / {100 * LONG_FRACTION:.0f}% {LONG_OUT[0]}-{LONG_OUT[1]} tok")
    return {
        "burst": f"burst, {lens}",
        "low": f"Poisson at 25% of continuous capacity, {lens}",
        "high": f"Poisson at 90% of continuous capacity, {lens}",
        "low/high/burst": lens,
        "prefix": f"{SHARED_PREFIX}-tok shared prefix + 16-32 private tok, 4 out, one request at a time",
    }[name]


def markdown(study: Study, model_name: str, figs: dict[str, str], elapsed_s: float) -> str:
    r = study.results
    names = [v for v in VARIANTS if f"{v}/burst" in r]
    lines = [
        "## Batching study (static vs dynamic vs continuous vs continuous + chunked prefill)",
        "",
        f"Measured by `benchmarks/batching_study.py` on {hardware_summary()}, model {model_name}, "
        f"git {git_commit(ROOT)}, max_num_seqs={MAX_NUM_SEQS}, chunked-prefill budget {CHUNK_TOKENS} tokens, "
        f"greedy, ignore_eos; whole study {elapsed_s / 60:.1f} min; 1-min load average "
        f"{' -> '.join(f'{x:.1f}' for x in study.loadavg)} (a shared machine). Rates: low "
        f"{study.rates.get('low', 0):.2f} req/s, high {study.rates.get('high', 0):.2f} req/s.",
        "",
        "### 1. Throughput, burst with long-tail output lengths",
        "",
    ]
    rows = []
    for v in names:
        s = r[f"{v}/burst"]["summary"]
        rows.append([v, s["completed"], s["output_throughput"], s["request_throughput"], s["median_e2el_ms"],
                     s["duration_s"]])
    lines += [markdown_table(["policy", "ok", "output tok/s", "req/s", "median e2e ms", "duration s"], rows)]
    lines += ["", "### 2. Latency under Poisson load", ""]
    rows = []
    for v in names:
        for w in ("low", "high"):
            s = r[f"{v}/{w}"]["summary"]
            rows.append([v, w, s["median_ttft_ms"], s["p90_ttft_ms"], s["median_e2el_ms"], s["p90_e2el_ms"],
                         s["p99_e2el_ms"], s["median_itl_ms"], s["output_throughput"]])
    lines += [markdown_table(["policy", "load", "median TTFT", "p90 TTFT", "median e2e", "p90 e2e", "p99 e2e",
                              "median ITL", "tok/s"], rows), "", "(milliseconds)", ""]
    lines += ["### 3. Long shared system prompt: prefix caching", ""]
    rows = [[k.split("/")[0], r[k]["summary"]["median_ttft_ms"], r[k]["summary"]["mean_ttft_ms"],
             r[k]["summary"]["p90_ttft_ms"]] for k in ("prefix cache on/prefix", "prefix cache off/prefix")
            if k in r]
    lines += [markdown_table(["", "median TTFT ms", "mean TTFT ms", "p90 TTFT ms"], rows), ""]
    lines += ["### Figures", ""] + [f"![{k}]({v})" for k, v in figs.items()] + [""]
    lines += ["### Expected shape, checked", ""] + [f"- {c}" for c in checks(study)]
    lines += [f"- note: {n}" for n in study.notes]
    return "\n".join(lines)


def checks(study: Study) -> list[str]:
    r = study.results
    out: list[str] = []

    def get(key: str, metric: str) -> float | None:
        return r[key]["summary"][metric] if key in r else None

    pairs = [("continuous/burst", "static/burst", "output_throughput", "throughput (burst)", False),
             ("continuous/low", "static/low", "median_e2el_ms", "median e2e latency at low load", True),
             ("continuous/high", "static/high", "median_e2el_ms", "median e2e latency near saturation", True)]
    for good, base, metric, what, lower_is_better in pairs:
        a, b = get(good, metric), get(base, metric)
        if a and b:
            ratio = b / a if lower_is_better else a / b
            out.append(f"continuous vs static, {what}: {ratio:.2f}x better")
    on = get("prefix cache on/prefix", "median_ttft_ms")
    off = get("prefix cache off/prefix", "median_ttft_ms")
    if on and off:
        cut = 100 * (1 - on / off)
        out.append(f"prefix caching cuts median TTFT by {cut:.0f}% ({off:.0f} -> {on:.0f} ms)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every workload's request count")
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M GGUF)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--deploy-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    from cbserve.config import CBServeConfig

    model_name = CBServeConfig(model=a.model).model_name
    study = Study(Path(a.out_dir), a.scale, a.model, a.deploy_timeout)
    t0 = time.monotonic()
    study.run(a.variants)
    figs = write_figures(study, model_name)
    md = markdown(study, model_name, figs, time.monotonic() - t0)
    md_path = Path(a.markdown)
    if not md_path.exists():
        md_path.write_text("# Benchmarks\n")
    replace_section(md_path, SECTION, md)
    (study.out_dir / "summary.json").write_text(json.dumps(
        {k: v["summary"] for k, v in study.results.items()} | {"rates": study.rates}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
