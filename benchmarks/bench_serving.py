"""Serving benchmark: the same client (``cbserve.bench``, streaming OpenAI completions, ignore_eos) against
``cbserve serve``, ``vllm serve`` (CPU, bf16) and llama.cpp's ``llama-server``, back to back on this machine,
plus cbserve offline (``cbserve.LLM`` in a child process) on the same requests.

Workloads (random word prompts, one token per word with the SmolLM2 tokenizer, fixed seed):
  burst    64 requests at once, prompts of 64-192 tokens, outputs of 64-192 tokens;
  poisson  the same 64 requests as a Poisson process at --poisson-fraction (0.9) x the first server's burst
           request rate (one rate for every server, so their latencies compare at the same offered load);
  single   one request at a time (max concurrency 1), 16 requests of 128 tokens in and 128 out.
Requests are greedy unless --temperature (and --top-p) say otherwise: the same sampling for every server
and for the offline run (``--temperature 1.0`` is what the OpenAI client's default leaves to the server).
Each server gets one warm-up request first. Reported per server and workload: output tok/s, TTFT, TPOT and
ITL (median, p99); then the ratios issue 17's goals ask for (cbserve / vLLM burst throughput, TTFT and TPOT;
served / offline throughput; single-request TPOT against llama.cpp). With --burst-rounds N the burst runs N
times on fresh prompts: round 0 with the other workloads, then each later round starts every server afresh,
runs only the burst, stops it, and runs offline (one round's figures minutes apart), and the burst's goal
ratios compare the rounds' medians. A server whose install is missing is skipped with a line saying so.
Prints a table, writes ``serving.json`` and ``serving.png`` to --out-dir.

``--cpu-breakdown`` samples, during cbserve's burst, the CPU seconds of every process of the deployment
(Serve proxy, ingress replica, SchedulerActor, WorkerActor, GCS, raylet...) and of the client; with
``--py-spy`` it also records the SchedulerActor with py-spy and prints its hottest frames.

The peers live outside the repo; ``bash benchmarks/peers/setup_peers.sh`` installs them (see its header).

    bash benchmarks/peers/setup_peers.sh                          # once: vLLM venv, HF folder, llama-server
    .venv/bin/python benchmarks/bench_serving.py --cpu-breakdown   # full run, ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_serving.py --servers cbserve offline --cbserve-args \\
        "--use-compiled-graph false --worker-torch-threads 2"   # cbserve only, other flags
    .venv/bin/python benchmarks/bench_serving.py --servers cbserve llama --workloads single   # vs llama.cpp
    .venv/bin/python benchmarks/bench_serving.py --quick --servers cbserve offline   # smoke test, ~1 min
    .venv/bin/python benchmarks/bench_serving.py --workloads burst --burst-rounds 3   # the goals on medians

Results go to benchmarks/results/serving.json (and serving.png); server logs to benchmarks/results/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbserve.bench.client import ClientConfig
from cbserve.bench.datasets import SampleRequest, sample_random
from cbserve.bench.deploy import HOST, free_port, local_deployment_process, server_process
from cbserve.bench.runner import LoadConfig, run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_offline import run_offline  # noqa: E402
from serving_report import format_report, goal_ratios, plot_serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("cbserve", "vllm", "offline", "llama")
WORKLOADS = ("burst", "poisson", "single")


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[SampleRequest]
    max_concurrency: int | None = None
    poisson: bool = False


def default_peers_dir() -> Path:
    """Where benchmarks/peers/setup_peers.sh installs the peers by default (its $PEERS)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cbserve-peers"


def burst_requests(args: argparse.Namespace, round_index: int = 0) -> list[SampleRequest]:
    """The burst's requests in a round of --burst-rounds: round 0 the burst workload's, every later round fresh
    prompts of the same shape (seed + 100 per round), so that no round finds an earlier one's prefixes cached."""
    n = 8 if args.quick else args.num_requests
    io = ((16, 32), (8, 16)) if args.quick else ((64, 192), (64, 192))
    return sample_random(n, io[0], io[1], seed=args.seed + 100 * round_index)


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    n1 = 4 if args.quick else args.single_requests
    single = 32 if args.quick else 128
    single_out = 16 if args.quick else 128
    burst = burst_requests(args)
    all_workloads = [
        Workload("burst", burst),
        Workload("poisson", burst, poisson=True),
        Workload("single", sample_random(n1, (single, single), (single_out, single_out), seed=args.seed + 1),
                 max_concurrency=1),
    ]
    return [w for w in all_workloads if w.name in args.workloads]


def run_workloads(name: str, base_url: str, workloads: list[Workload], state: dict[str, Any],
                  args: argparse.Namespace, on_burst: Any = None) -> dict[str, Any]:
    """Run every workload against one server; ``state["poisson_rate"]`` is set from the first burst."""
    client = client_config(base_url, args)
    out: dict[str, Any] = {}
    for wl in workloads:
        if wl.poisson:
            rate = state.get("poisson_rate")
            if rate is None:
                print(f"[{name}] poisson: no rate (no burst measured)", flush=True)
                continue
        else:
            rate = float("inf")
        load = LoadConfig(request_rate=rate, max_concurrency=wl.max_concurrency, seed=args.seed,
                          request_timeout_s=args.request_timeout, progress=not args.quiet)
        print(f"[{name}] {wl.name}: {len(wl.requests)} requests, rate {rate:g}/s, "
              f"max concurrency {wl.max_concurrency}", flush=True)
        ctx = on_burst() if (wl.name == "burst" and on_burst) else contextlib.nullcontext()
        with ctx as extra:
            doc = run_benchmark(client, wl.requests, load, warmup=1 if wl.name == "burst" else 0,
                                label=f"{name} {wl.name}")
        if isinstance(extra, dict):
            doc.update(extra)
        s = doc["summary"]
        print(f"[{name}] {wl.name}: {s['completed']}/{s['num_requests']} ok, {s['output_throughput']:.1f} "
              f"tok/s, median TTFT {s['median_ttft_ms']:.0f} ms, median TPOT {s['median_tpot_ms']:.1f} ms",
              flush=True)
        out[wl.name] = doc
        if wl.name == "burst" and "poisson_rate" not in state and s["completed"]:
            state["poisson_rate"] = args.poisson_rate or args.poisson_fraction * s["request_throughput"]
    return out


def client_config(base_url: str, args: argparse.Namespace) -> ClientConfig:
    """The client every server gets: ignore_eos, and the run's sampling (top_p sent only when below 1)."""
    extra = {"top_p": args.top_p} if args.top_p < 1.0 else {}
    return ClientConfig(base_url=base_url, model="", ignore_eos=True, temperature=args.temperature, extra_body=extra)


# ---- servers ---------------------------------------------------------------------------------------------
def run_cbserve(workloads: list[Workload], state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    log = Path(args.out_dir) / "logs" / "cbserve_serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.cbserve_args)
    print(f"[cbserve] starting: cbserve serve {args.cbserve_args} (log {log})", flush=True)
    t0 = time.perf_counter()
    with local_deployment_process({}, args.ready_timeout, log, extra) as (base_url, proc):
        print(f"[cbserve] ready in {time.perf_counter() - t0:.0f} s", flush=True)
        probe = _CbserveProbe(base_url, proc.pid, args)
        res = run_workloads("cbserve", base_url, workloads, state, args, on_burst=probe.during_burst)
    res["server"] = {"cmd": "cbserve serve " + args.cbserve_args, "log": str(log)}
    return res


class _CbserveProbe:
    """Around cbserve's burst: /stats before and after (dispatch figures), per-process CPU, py-spy."""

    def __init__(self, base_url: str, root_pid: int, args: argparse.Namespace) -> None:
        self.base_url, self.root_pid, self.args = base_url, root_pid, args

    @contextlib.contextmanager
    def during_burst(self) -> Iterator[dict[str, Any]]:
        from cbserve.bench.cpu_profile import CpuSampler

        extra: dict[str, Any] = {}
        before = _get_json(self.base_url + "/stats")
        sampler = CpuSampler(self.root_pid, client_pid=os.getpid()) if self.args.cpu_breakdown else None
        spy = None
        if sampler is not None:
            sampler.start()
            spy = self._start_py_spy(sampler, extra) if self.args.py_spy else None
        try:
            yield extra
        finally:
            if sampler is not None:
                sampler.stop()
                extra["cpu_breakdown"] = sampler.report()
            if spy is not None:
                extra["py_spy"] = self._finish_py_spy(*spy)
            extra["stats_before"], extra["stats_after"] = before, _get_json(self.base_url + "/stats")

    def _start_py_spy(self, sampler: Any, extra: dict[str, Any]) -> tuple[Any, Path, int] | None:
        from cbserve.bench.cpu_profile import py_spy_dump, start_py_spy_record

        pids = sampler.pids("ray::SchedulerActor")
        if not pids:
            extra["py_spy"] = {"error": "no ray::SchedulerActor process found"}
            return None
        out = Path(self.args.out_dir) / "scheduler_py_spy.txt"
        extra["py_spy_dump_start"] = py_spy_dump(pids[0])
        return start_py_spy_record(pids[0], self.args.py_spy_seconds, out), out, pids[0]

    @staticmethod
    def _finish_py_spy(proc: Any, out: Path, pid: int) -> dict[str, Any]:
        from cbserve.bench.cpu_profile import top_frames

        if proc is None:
            return {"error": "py-spy not found"}
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=120)
        text = out.read_text() if out.exists() else ""
        return {"pid": pid, "file": str(out), "top_frames": top_frames(text, 20)}


def run_vllm(workloads: list[Workload], state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    exe = Path(args.vllm_venv) / "bin" / "vllm"
    if not exe.exists() or not (Path(args.vllm_model) / "config.json").exists():
        return {"skipped": f"vLLM not installed ({exe}) or no model folder ({args.vllm_model}): "
                           "run benchmarks/peers/setup_peers.sh"}
    port = free_port()
    cmd = [str(exe), "serve", args.vllm_model, "--dtype", "bfloat16", "--host", HOST, "--port", str(port),
           *shlex.split(args.vllm_args)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RAY_ADDRESS")}
    env["PATH"] = f"{exe.parent}:{env.get('PATH', '')}"
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return _run_peer("vllm", cmd, env, port, workloads, state, args)


def run_llama(workloads: list[Workload], state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from cbserve.worker.loading.model_info import default_model_path

    exe = Path(args.llama_server)
    if not exe.exists():
        return {"skipped": f"llama-server not found at {exe}: run benchmarks/peers/setup_peers.sh llama"}
    port = free_port()
    ctx = args.llama_parallel * (512 if not args.quick else 128)
    cmd = [str(exe), "-m", args.gguf or default_model_path(), "--host", HOST, "--port", str(port),
           "--parallel", str(args.llama_parallel), "-c", str(ctx), "-t", str(os.cpu_count() or 1),
           *shlex.split(args.llama_args)]
    return _run_peer("llama", cmd, dict(os.environ), port, workloads, state, args)


def _run_peer(name: str, cmd: list[str], env: dict[str, str], port: int, workloads: list[Workload],
              state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    log = Path(args.out_dir) / "logs" / f"{name}_serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    base_url = f"http://{HOST}:{port}"
    print(f"[{name}] starting: {shlex.join(cmd)} (log {log})", flush=True)
    t0 = time.perf_counter()
    try:
        with server_process(cmd, base_url, args.ready_timeout, log, env) as _:
            print(f"[{name}] ready in {time.perf_counter() - t0:.0f} s", flush=True)
            res = run_workloads(name, base_url, workloads, state, args)
    except (RuntimeError, TimeoutError) as e:
        return {"skipped": f"{name} failed to start: {e} (see {log})"}
    res["server"] = {"cmd": shlex.join(cmd), "log": str(log)}
    return res


def run_offline_burst(reqs: list[SampleRequest], args: argparse.Namespace, label: str) -> dict[str, Any]:
    """cbserve.LLM on one burst's requests, in a child process (serving_offline.py)."""
    print(f"[offline] {label}: cbserve.LLM on {len(reqs)} requests", flush=True)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    res = run_offline(reqs, args.offline_kwargs, sampling, args.request_timeout + args.ready_timeout)
    if "skipped" in res:
        return res
    print(f"[offline] {label}: {res['output_throughput']:.1f} tok/s in {res['duration_s']:.1f} s "
          f"({res['cpu_s'] / res['duration_s']:.2f} cores)", flush=True)
    return {"burst": {"summary": res, "label": "offline burst"}}


def run_one(name: str, workloads: list[Workload], burst: list[SampleRequest], state: dict[str, Any],
            args: argparse.Namespace, label: str = "burst") -> dict[str, Any]:
    """One server on ``workloads``, or offline on ``burst`` (the burst's requests, whatever the workloads)."""
    if name == "offline":
        return run_offline_burst(burst, args, label)
    return {"cbserve": run_cbserve, "vllm": run_vllm, "llama": run_llama}[name](workloads, state, args)


def run_rounds(names: list[str], results: dict[str, Any], state: dict[str, Any], args: argparse.Namespace) -> None:
    """Rounds 1.. of the burst (round 0 ran with the other workloads): in each round every server is started
    afresh, runs the round's burst and is stopped, then offline runs it; so each round's figures are minutes
    apart, and a drift of this machine's speed moves all of a round alike. A server that fails a round loses
    its rounds (no median of fewer rounds than the others')."""
    for name in names:
        results[name]["burst_rounds"] = [results[name]["burst"]["summary"]]
    for i in range(1, args.burst_rounds):
        reqs = burst_requests(args, i)
        one = argparse.Namespace(**{**vars(args), "burst_rounds": 1, "cpu_breakdown": False, "py_spy": False,
                                    "out_dir": str(Path(args.out_dir) / f"round{i}")})  # its servers' logs
        for name in [n for n in names if "burst_rounds" in results[n]]:
            res = run_one(name, [Workload("burst", reqs)], reqs, dict(state), one, f"burst round {i}")
            summary = res.get("burst", {}).get("summary")
            if not summary or not summary.get("completed"):
                print(f"[{name}] burst round {i} FAILED ({res.get('skipped', 'no request completed')}): its "
                      f"rounds are dropped", flush=True)
                del results[name]["burst_rounds"]
                continue
            results[name]["burst_rounds"].append(summary)
            print(f"[{name}] burst round {i}: {summary['output_throughput']:.1f} tok/s", flush=True)


# ---- main ------------------------------------------------------------------------------------------------
def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                   help="poisson without burst needs --poisson-rate; offline always runs the burst's requests")
    p.add_argument("--quick", action="store_true", help="8 short requests, 4 single ones (tests)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--single-requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst-rounds", type=int, default=1,
                   help="bursts per server, and offline, each on fresh prompts: the goal ratios then compare "
                        "the rounds' medians (one burst on this machine moves ~10%% between runs)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling of every request (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of every request (1: off)")
    p.add_argument("--poisson-rate", type=float, default=None, help="req/s (default: from the first burst)")
    p.add_argument("--poisson-fraction", type=float, default=0.9)
    p.add_argument("--cbserve-args", default="", help="extra `cbserve serve` flags, one string")
    p.add_argument("--offline-kwargs", default="{}", help="JSON of cbserve.LLM keyword arguments")
    peers = default_peers_dir()
    p.add_argument("--vllm-venv", default=str(peers / "vllm-venv"), help="(benchmarks/peers/setup_peers.sh)")
    p.add_argument("--vllm-model", default=str(peers / "smollm2-hf"))
    p.add_argument("--vllm-args", default="--gpu-memory-utilization 0.15",
                   help="extra `vllm serve` flags, one string (on CPU --gpu-memory-utilization is the share of "
                        "RAM vLLM reserves, 0.92 by default: more than a shared 24 GiB machine has free)")
    p.add_argument("--llama-server", default=str(peers / "llama" / "llama-server"))
    p.add_argument("--llama-parallel", type=int, default=64)
    p.add_argument("--llama-args", default="", help="extra llama-server flags, one string")
    p.add_argument("--gguf", default=None, help="GGUF for llama-server (default: the bundled SmolLM2)")
    p.add_argument("--cpu-breakdown", action="store_true", help="CPU seconds per process in cbserve's burst")
    p.add_argument("--py-spy", action="store_true", help="with --cpu-breakdown: py-spy the SchedulerActor")
    p.add_argument("--py-spy-seconds", type=float, default=30.0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.burst_rounds < 1:
        p.error(f"--burst-rounds must be at least 1 (got {args.burst_rounds})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    workloads = build_workloads(args)
    state: dict[str, Any] = {}
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name in [s for s in SERVERS if s in args.servers]:
        results[name] = run_one(name, workloads, burst_requests(args), state, args)
        if "skipped" in results[name]:
            print(f"[{name}] SKIPPED: {results[name]['skipped']}", flush=True)
    if args.burst_rounds > 1:
        run_rounds([n for n, r in results.items() if r.get("burst", {}).get("summary")], results, state, args)
    doc = {"config": {**vars(args), "poisson_rate": state.get("poisson_rate"),
                      "total_wall_s": time.perf_counter() - t0},
           "results": results, "ratios": goal_ratios(results)}
    doc["config"].update(_machine(), cpu_isa=_cbserve_isa(args))
    out = Path(args.out_dir) / "serving.json"
    out.write_text(json.dumps(doc, indent=1))
    print(format_report(doc))
    png = Path(args.out_dir) / "serving.png"
    plot_serving(doc, png)
    print(f"wrote {out} and {png}")
    return 0 if "cbserve" not in args.servers or cbserve_completed(results.get("cbserve", {}), workloads) else 1


def cbserve_completed(result: dict[str, Any], workloads: list[Workload]) -> bool:
    """Whether cbserve answered requests in every workload it ran (the exit status: 1 when it did not)."""
    return all(result.get(w.name, {}).get("summary", {}).get("completed", 0) > 0 for w in workloads)


def _machine() -> dict[str, Any]:
    from cbserve.bench.report import cpu_model, git_commit

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "commit": git_commit(ROOT),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _cbserve_isa(args: argparse.Namespace) -> str:
    """The ISA level of cbserve's C kernels in this run: the --cpu-isa of --cbserve-args, else the CPU's best."""
    from cbserve.worker.cpu.native import resolve_isa

    flag = argparse.ArgumentParser(add_help=False)
    flag.add_argument("--cpu-isa", default="auto")
    return resolve_isa(flag.parse_known_args(shlex.split(args.cbserve_args))[0].cpu_isa)


if __name__ == "__main__":
    raise SystemExit(main())
