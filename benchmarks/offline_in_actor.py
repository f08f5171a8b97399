"""Does the Ray actor around the model cost the engine anything? The serving benchmark's burst through
``cbserve.LLM`` in a plain process, then inside a Ray actor with the model on a thread of its own (as
``cluster/engine/worker_actor.py`` runs it), alternated, each in a fresh child process. No server, no client: what
a served burst loses beyond these numbers is the other processes' CPU, not the worker's surroundings.

    .venv/bin/python benchmarks/offline_in_actor.py --rounds 2

Prints output tok/s and the cores the engine's process used, per run and as means."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parent)


def burst(seed: int, dtype: str) -> dict[str, float]:
    """The serving benchmark's burst (64 random prompts of 64-192 tokens, outputs of 64-192, greedy,
    ignore_eos) through ``serving_offline.offline_summary`` on a thread of its own: output tok/s and the
    process's cores over the generate call."""
    import torch
    from serving_offline import offline_summary

    from cbserve.bench.datasets import sample_random

    reqs, result = sample_random(64, (64, 192), (64, 192), seed=seed), {}

    def run() -> None:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        result.update(offline_summary(reqs, {"dtype": dtype}, {"temperature": 0.0}))

    thread = threading.Thread(target=run, name="cbserve-model")
    thread.start()
    thread.join()
    return {"tok_s": result["output_throughput"], "cores": result["cpu_s"] / result["duration_s"]}


def in_actor(seed: int, dtype: str) -> dict[str, float]:
    """``burst`` inside a Ray actor of a local instance started with the environment `cbserve serve` gives its
    own (actors at niceness 0, OpenMP over the node's cores)."""
    import ray

    cores = len(os.sched_getaffinity(0))
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)  # serving_offline, in the actor
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(cores), "PYTHONPATH": path}})
    try:
        runner = ray.remote(num_cpus=1)(_Runner).remote()
        return ray.get(runner.run.remote(seed, dtype))
    finally:
        ray.shutdown()


class _Runner:
    def run(self, seed: int, dtype: str) -> dict[str, float]:
        return burst(seed, dtype)


def child(where: str, seed: int, dtype: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", where, "--seed", str(seed), "--dtype", dtype]
    env = {**os.environ, "RAY_worker_niceness": "0"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--child", choices=["plain", "actor"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        run = burst if args.child == "plain" else in_actor
        print(json.dumps(run(args.seed, args.dtype)), flush=True)
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "actor": []}
    for r in range(args.rounds):
        for where in ("plain", "actor") if r % 2 == 0 else ("actor", "plain"):
            row = child(where, args.seed + r, args.dtype)
            rows[where].append(row)
            print(f"round {r} {where:5s} {row['tok_s']:7.1f} tok/s  {row['cores']:.2f} cores", flush=True)
    means = {w: statistics.mean(x["tok_s"] for x in rs) for w, rs in rows.items()}
    print(f"means: plain {means['plain']:.1f}, actor {means['actor']:.1f} tok/s "
          f"(actor / plain {means['actor'] / means['plain']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
