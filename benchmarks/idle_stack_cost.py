"""What an idle serving stack costs the engine: cbserve's offline engine (``cbserve.LLM``, the serving burst's
shapes: 64 random prompts of 64-192 tokens, outputs of 64-192, greedy, ignore_eos) runs bursts next to an idle
`cbserve serve` (no requests) whose processes are, burst by burst, all running or partly frozen (SIGSTOP,
which takes a process's CPU and wake-ups away as if it were not there).

Layouts, alternated round by round: ``running`` (nothing frozen), ``all`` (every process of the serving stack
but Ray's GCS and raylet), or ``+``-joined groups to freeze: ``engine`` (the idle scheduler and worker actors),
``serve`` (Serve's controller, its proxy, the ingress replica), ``head`` (Ray's dashboard and its modules),
``agent`` (Ray's dashboard agent: the metrics exporter), ``monitors`` (Ray's log and autoscaler monitors).
Prints tok/s and the engine's cores per burst, and the means per layout.

    .venv/bin/python benchmarks/idle_stack_cost.py --rounds 4 --layouts running all
    .venv/bin/python benchmarks/idle_stack_cost.py --rounds 3 --layouts running engine serve head --ray-dashboard
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from cbserve.bench.deploy import local_deployment_process

GROUPS = ("engine", "serve", "head", "agent", "monitors")
_OFFLINE = r"""
import json, sys
from cbserve import LLM, SamplingParams
from cbserve.bench.datasets import sample_random
from serving_offline import offline_burst
llm = LLM(dtype="bfloat16", progress=False)
llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
for line in sys.stdin:
    s = offline_burst(llm, sample_random(64, (64, 192), (64, 192), seed=int(line)), {"temperature": 0.0})
    print(json.dumps({"tok_s": s["output_throughput"], "cores": s["cpu_s"] / s["duration_s"]}), flush=True)
"""


def process_group(cmdline: str) -> str | None:
    """Which group of the serving stack a process is in (None: never frozen: Ray's GCS and raylet, the CLI)."""
    if "SchedulerActor" in cmdline or "WorkerActor" in cmdline:
        return "engine"
    if any(name in cmdline for name in ("ServeController", "ProxyActor", "ServeReplica")):
        return "serve"
    if "dashboard/agent.py" in cmdline or "DashboardAgent" in cmdline:
        return "agent"
    if "log_monitor" in cmdline or "autoscaler" in cmdline:
        return "monitors"
    if "dashboard" in cmdline:
        return "head"
    return None


def frozen_groups(layout: str) -> set[str]:
    if layout == "running":
        return set()
    if layout == "all":
        return set(GROUPS)
    groups = set(layout.split("+"))
    if not groups <= set(GROUPS):
        raise ValueError(f"unknown group in {layout!r}: choose from running, all, {', '.join(GROUPS)}")
    return groups


def freeze(stack: list[psutil.Process], groups: set[str]) -> None:
    for process in stack:
        try:
            group = process_group(" ".join(process.cmdline()))
            process.send_signal(signal.SIGSTOP if group in groups else signal.SIGCONT)
        except psutil.Error:
            continue


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", default=["running", "all"])
    ap.add_argument("--ray-dashboard", action="store_true", help="serve with Ray's dashboard (cbserve's flag)")
    args = ap.parse_args()
    for layout in args.layouts:
        frozen_groups(layout)  # refuses an unknown group before anything starts
    rows: list[dict] = []
    engine = subprocess.Popen([sys.executable, "-c", _OFFLINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parent)  # fmt: skip
    assert engine.stdin is not None and engine.stdout is not None
    flags = ["--dtype", "bfloat16", *(["--ray-dashboard"] if args.ray_dashboard else [])]
    with tempfile.TemporaryDirectory() as tmp, local_deployment_process({}, 600.0, Path(tmp) / "s.log", flags) as (
        _, proc
    ):
        stack = [*psutil.Process(proc.pid).children(recursive=True)]
        try:
            for r in range(args.rounds):
                for i, layout in enumerate(args.layouts if r % 2 == 0 else args.layouts[::-1]):
                    freeze(stack, frozen_groups(layout))
                    engine.stdin.write(f"{200 + len(args.layouts) * r + i}\n")
                    engine.stdin.flush()
                    row = {"round": r, "layout": layout, **json.loads(engine.stdout.readline())}
                    rows.append(row)
                    print(f"round {r} {layout:16s} {row['tok_s']:7.1f} tok/s  engine {row['cores']:.3f} cores",
                          flush=True)  # fmt: skip
        finally:
            freeze(stack, set())
    engine.stdin.close()
    engine.wait()
    for layout in args.layouts:
        mine = [row for row in rows if row["layout"] == layout]
        print(f"{layout:16s} mean {statistics.mean(r['tok_s'] for r in mine):7.1f} tok/s, "
              f"engine {statistics.mean(r['cores'] for r in mine):.3f} cores")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
