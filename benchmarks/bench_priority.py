"""CPU priority A/B on one `cbserve serve`: Ray's default priorities against cbserve's, alternated between bursts.

One server (its own local Ray instance), warmed up; then for each round and each layout, every thread of its
processes is reniced to that layout and one burst runs (`cbserve bench`: 64 random prompts of 64-192 tokens,
outputs of 64-192, greedy, ignore_eos; a new seed per burst, so no burst reuses another's prefixes).
Layouts (cluster/ops/cpu_priority.py):
  ray      Ray's defaults: actor processes at niceness 15, Ray's own daemons (GCS, dashboard, agents...) at 0;
  nice     the engine (scheduler actor, model workers) and the raylet at 0, the HTTP edge (ingress replica,
           Serve's proxy) at 10, everything else at 19, all under SCHED_OTHER (cbserve before SCHED_BATCH);
  cbserve  what `cbserve serve` sets: the niceness of `nice`, and SCHED_BATCH for the edge and the rest;
  batchsched  cbserve's, with the scheduler actor under SCHED_BATCH too (niceness 0): it then waits for the
           scheduler tick instead of preempting the model's OpenMP team when a step's output arrives.
The same server and client for both, so the machine's drift between runs hits both layouts alike. Lowering a
niceness needs root (or CAP_SYS_NICE): run it as root.

    sudo .venv/bin/python benchmarks/bench_priority.py --rounds 4 --layouts ray cbserve
    sudo .venv/bin/python benchmarks/bench_priority.py --rounds 6 --layouts nice cbserve \
        --input-len 128 --output-len 128
    sudo .venv/bin/python benchmarks/bench_priority.py --rounds 5 --layouts cbserve batchsched
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from cbserve.bench.deploy import local_deployment_process
from cbserve.cluster.ops.cpu_priority import BACKGROUND, EDGE, ENGINE, Priority, set_priority

LAYOUTS = ("ray", "nice", "cbserve", "batchsched")


def _layout_priority(layout: str, title: str, engine: bool) -> Priority | None:
    if os.path.basename(title) == "raylet" or title.startswith("ray::IDLE"):
        return None
    if layout == "ray":
        return Priority(15 if title.startswith("ray::") else 0)
    if engine:
        scheduler = title.startswith("ray::SchedulerActor")
        return Priority(ENGINE.niceness, EDGE.policy) if layout == "batchsched" and scheduler else ENGINE
    edge = title.startswith(("ray::ServeReplica", "ray::ProxyActor"))
    priority = EDGE if edge else BACKGROUND
    return Priority(priority.niceness) if layout == "nice" else priority


def apply_layout(layout: str, root: int, engine_pids: set[int]) -> None:
    tree = psutil.Process(root)
    for process in [tree, *tree.children(recursive=True)]:
        try:
            title = (process.cmdline() or [""])[0]
        except psutil.Error:
            continue
        priority = _layout_priority(layout, title, process.pid in engine_pids)
        if priority is not None:
            set_priority(process.pid, priority)


def _stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url + "/stats", timeout=30) as r:
        (replica,) = json.loads(r.read())["replicas"]
    return replica


def burst(base_url: str, seed: int, out: Path, lengths: tuple[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "cbserve.cluster.cli.main", "bench", "--base-url", base_url + "/v1", "--dataset",
           "random", "--num-prompts", "64", "--input-len", lengths[0], "--output-len", lengths[1], "--temperature",
           "0", "--seed", str(seed), "--disable-tqdm", "--result-file", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def _cpu_s(pids: set[int]) -> float:
    times = [psutil.Process(pid).cpu_times() for pid in pids]
    return sum(t.user + t.system for t in times)


def measured_burst(base_url: str, seed: int, tmp: Path, args: argparse.Namespace, engine: set[int]) -> dict:
    """One burst: the client's numbers, the dispatch overhead a step, and the engine's CPU (cores) over it."""
    before, cpu0, t0 = _stats(base_url), _cpu_s(engine), time.monotonic()
    s = burst(base_url, seed, tmp / "run.json", (args.input_len, args.output_len))
    after, cores = _stats(base_url), (_cpu_s(engine) - cpu0) / (time.monotonic() - t0)
    calls = after["dispatch_calls"] - before["dispatch_calls"]
    overhead = (after["dispatch_calls"] * after["dispatch_overhead_ms_mean"]
                - before["dispatch_calls"] * before["dispatch_overhead_ms_mean"]) / max(calls, 1)  # fmt: skip
    return {"tok_s": s["output_throughput"], "ttft_ms": s["median_ttft_ms"], "tpot_ms": s["median_tpot_ms"],
            "overhead_ms": overhead, "engine_cores": cores}  # fmt: skip


def report(rows: list[dict[str, Any]], layouts: list[str], rounds: int) -> dict[str, float]:
    """Mean tok/s per layout; the last layout against the first, round by round."""
    means = {lay: statistics.mean(r["tok_s"] for r in rows if r["layout"] == lay) for lay in layouts}
    first, last = layouts[0], layouts[-1]
    wins = sum(a["tok_s"] < b["tok_s"] for a, b in zip(
        [r for r in rows if r["layout"] == first], [r for r in rows if r["layout"] == last], strict=True))
    print("means: " + ", ".join(f"{lay} {m:.1f} tok/s" for lay, m in means.items())
          + f"; {last} / {first} {means[last] / means[first]:.3f}x, ahead in {wins} of {rounds} rounds")
    return means


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["ray", "cbserve"])
    ap.add_argument("--input-len", default="64:192", help="cbserve bench's --input-len")
    ap.add_argument("--output-len", default="64:192", help="cbserve bench's --output-len")
    ap.add_argument("--cbserve-args", default="--dtype bfloat16")
    ap.add_argument("--out", default="benchmarks/results/priority.json")
    args = ap.parse_args()
    if len(set(args.layouts)) < 2:
        ap.error("--layouts: name at least two different layouts to compare")
    if os.geteuid() != 0:
        print("bench_priority: lowering a niceness back to Ray's defaults needs root", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, local_deployment_process(
        {}, 600.0, Path(tmp) / "serve.log", args.cbserve_args.split()
    ) as (base_url, proc):
        engine = set(_stats(base_url)["engine_pids"])
        burst(base_url, 1, Path(tmp) / "warm.json", (args.input_len, args.output_len))
        for r in range(args.rounds):
            for i, layout in enumerate(args.layouts if r % 2 == 0 else args.layouts[::-1]):
                apply_layout(layout, proc.pid, engine)
                row = {"round": r, "layout": layout,
                       **measured_burst(base_url, 100 + len(args.layouts) * r + i, Path(tmp), args, engine)}
                rows.append(row)
                print(f"round {r} {layout:8s} {row['tok_s']:7.1f} tok/s  TTFT {row['ttft_ms']:7.0f} ms  "
                      f"TPOT {row['tpot_ms']:6.1f} ms  dispatch overhead {row['overhead_ms']:5.2f} ms/step  "
                      f"engine {row['engine_cores']:.2f} cores", flush=True)
    means = report(rows, args.layouts, args.rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "means": means}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
