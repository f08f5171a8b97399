"""CPU priority A/B on one `cbserve serve`: Ray's default niceness against cbserve's, alternated between bursts.

One server (its own local Ray instance), warmed up; then for each round and each layout, every thread of its
processes is reniced to that layout and one burst runs (`cbserve bench`: 64 random prompts of 64-192 tokens,
outputs of 64-192, greedy, ignore_eos; a new seed per burst, so no burst reuses another's prefixes).
Layouts (cluster/cpu_priority.py):
  ray      Ray's defaults: actor processes at niceness 15, Ray's own daemons (GCS, dashboard, agents...) at 0;
  cbserve  what `cbserve serve` sets: the engine (scheduler actor, model workers) and the raylet at 0, the
           HTTP edge (ingress replica, Serve's proxy) at 10, everything else at 19.
The same server and client for both, so the machine's drift between runs hits both layouts alike. Lowering a
niceness needs root (or CAP_SYS_NICE): run it as root.

    sudo .venv/bin/python benchmarks/bench_priority.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from cbserve.bench.deploy import local_deployment_process
from cbserve.cluster.cpu_priority import BACKGROUND_NICENESS, EDGE_NICENESS, set_niceness

LAYOUTS = ("ray", "cbserve")


def _layout_niceness(layout: str, title: str, engine: bool) -> int | None:
    if os.path.basename(title) == "raylet" or title.startswith("ray::IDLE"):
        return None
    if layout == "ray":
        return 15 if title.startswith("ray::") else 0
    if engine:
        return 0
    if title.startswith(("ray::ServeReplica", "ray::ProxyActor")):
        return EDGE_NICENESS
    return BACKGROUND_NICENESS


def apply_layout(layout: str, root: int, engine_pids: set[int]) -> None:
    tree = psutil.Process(root)
    for process in [tree, *tree.children(recursive=True)]:
        try:
            title = (process.cmdline() or [""])[0]
        except psutil.Error:
            continue
        nice = _layout_niceness(layout, title, process.pid in engine_pids)
        if nice is not None:
            set_niceness(process.pid, nice)


def _stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url + "/stats", timeout=30) as r:
        (replica,) = json.loads(r.read())["replicas"]
    return replica


def burst(base_url: str, seed: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "cbserve.cluster.cli", "bench", "--base-url", base_url + "/v1", "--dataset",
           "random", "--num-prompts", "64", "--input-len", "64:192", "--output-len", "64:192", "--temperature",
           "0", "--seed", str(seed), "--disable-tqdm", "--result-file", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cbserve-args", default="--dtype bfloat16")
    ap.add_argument("--out", default="benchmarks/results/priority.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_priority: lowering a niceness back to Ray's defaults needs root", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, local_deployment_process(
        {}, 600.0, Path(tmp) / "serve.log", args.cbserve_args.split()
    ) as (base_url, proc):
        engine = set(_stats(base_url)["engine_pids"])
        burst(base_url, 1, Path(tmp) / "warm.json")
        for r in range(args.rounds):
            for i, layout in enumerate(LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
                apply_layout(layout, proc.pid, engine)
                before = _stats(base_url)
                s = burst(base_url, 100 + 2 * r + i, Path(tmp) / "run.json")
                after = _stats(base_url)
                calls = after["dispatch_calls"] - before["dispatch_calls"]
                overhead = (after["dispatch_calls"] * after["dispatch_overhead_ms_mean"]
                            - before["dispatch_calls"] * before["dispatch_overhead_ms_mean"]) / max(calls, 1)
                row = {"round": r, "layout": layout, "tok_s": s["output_throughput"],
                       "ttft_ms": s["median_ttft_ms"], "tpot_ms": s["median_tpot_ms"], "overhead_ms": overhead}
                rows.append(row)
                print(f"round {r} {layout:8s} {row['tok_s']:7.1f} tok/s  TTFT {row['ttft_ms']:7.0f} ms  "
                      f"TPOT {row['tpot_ms']:6.1f} ms  dispatch overhead {overhead:5.2f} ms/step", flush=True)
    means = {lay: statistics.mean(r["tok_s"] for r in rows if r["layout"] == lay) for lay in LAYOUTS}
    wins = sum(a["tok_s"] < b["tok_s"] for a, b in zip(
        [r for r in rows if r["layout"] == "ray"], [r for r in rows if r["layout"] == "cbserve"], strict=True))
    print(f"means: ray {means['ray']:.1f} tok/s, cbserve {means['cbserve']:.1f} tok/s "
          f"({means['cbserve'] / means['ray']:.3f}x); cbserve ahead in {wins} of {args.rounds} rounds")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "means": means}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
