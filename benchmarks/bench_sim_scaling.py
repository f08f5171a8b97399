"""How much the serving layer carries: requests/s and streamed tokens/s through ONE ingress replica of
``cbserve serve --model sim`` (the simulated engine: each step sleeps for what an H100 serving Llama-3-8B would
take, worker/sim_cost.py), and how that scales with engine replicas (``num_replicas``).

Short prompts and short answers, sent by ``--concurrency`` clients in a closed loop (``cbserve bench``'s runner,
streamed /v1/completions), so the stack (HTTP, the front end, router, channels, scheduler), not the simulated GPU,
is the limit: each level of concurrency is raised until requests/s stop growing. ``--ingress-replicas`` runs
several ingress replicas (a fixed ``autoscaling`` range: Serve's proxy then fronts them), and ``--nodes N`` runs
the deployment on simulated nodes of one machine (``ray.cluster_utils.Cluster``: a head without CPUs, where
Serve's controller and proxy live, and N nodes of ``--node-cpus`` logical CPUs that the ingress replicas, their
engines and workers are spread over); ``cbserve serve`` joins that cluster. CPU seconds per process are
sampled during every run (``cbserve.bench.cpu_profile``), and with ``--profile`` the ingress replica is recorded
with py-spy at the highest concurrency: the first bottleneck is the process that is busy all the time, and its
hottest frames say why. The load generator shares the machine's cores: its CPU is reported with the rest.

    .venv/bin/python benchmarks/bench_sim_scaling.py                        # replicas 1,2,4; concurrency 8..128
    .venv/bin/python benchmarks/bench_sim_scaling.py --replicas 1 --concurrency 32 --requests 100   # smoke
    .venv/bin/python benchmarks/bench_sim_scaling.py --nodes 2 --ingress-replicas 1,2 --replicas 2   # nodes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import describe  # noqa: E402

from cbserve.bench.client import ClientConfig  # noqa: E402
from cbserve.bench.cpu_profile import (  # noqa: E402
    CpuSampler,
    format_cpu_table,
    inclusive_frames,
    start_py_spy_record,
    top_frames,
)
from cbserve.bench.datasets import sample_random  # noqa: E402
from cbserve.bench.deploy import local_deployment_process  # noqa: E402
from cbserve.bench.runner import LoadConfig, run_benchmark  # noqa: E402
from cbserve.worker.cpu import native  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "sim_scaling"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=_ints, default=[1, 2, 4], help="engine replicas (num_replicas) to run")
    p.add_argument("--ingress-replicas", type=_ints, default=[1], help="ingress replicas (each with its engines)")
    p.add_argument("--nodes", type=int, default=0,
                   help="simulated nodes (ray.cluster_utils.Cluster); 0: cbserve serve starts its own Ray")
    p.add_argument("--node-cpus", type=int, default=2, help="logical CPUs of each simulated node")
    p.add_argument("--concurrency", type=_ints, default=[8, 32, 128], help="clients in flight")
    p.add_argument("--requests", type=int, default=300, help="requests per run")
    p.add_argument("--input-words", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="py-spy the ingress at the highest concurrency")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def one_run(base_url: str, server_pid: int, concurrency: int, args: argparse.Namespace,
            profile_to: Path | None) -> dict[str, Any]:
    requests = sample_random(args.requests, (args.input_words, args.input_words),
                             (args.output_tokens, args.output_tokens), seed=concurrency)
    client = ClientConfig(base_url=base_url, model="sim", endpoint="completions", ignore_eos=True)
    load = LoadConfig(max_concurrency=concurrency, progress=False)
    with CpuSampler(server_pid, client_pid=os.getpid()) as sampler:
        spy = None
        if profile_to is not None:
            ingress = sampler.pids("ray::ServeReplica")
            if ingress:
                spy = start_py_spy_record(ingress[0], 5, profile_to, rate=100)
        result = run_benchmark(client, requests, load, warmup=min(8, concurrency))
    if spy is not None:
        spy.wait(timeout=60)
    s = result["summary"]
    cpu = sampler.report()
    row = {"concurrency": concurrency, "requests": s["completed"], "failed": s["failed"],
           "duration_s": s["duration_s"], "requests_per_s": s["request_throughput"],
           "output_tokens_per_s": s["output_throughput"], "ttft_p50_ms": _pct(result, "ttft", 50),
           "latency_p50_ms": _pct(result, "latency", 50),
           "cpu_cores_by_process": {r["process"]: round(r["cores"], 3) for r in cpu["by_process"]
                                    if r["cpu_s"] >= 0.05},
           # CPU per request of each kind of process (warm-up requests included: they ran in the window too)
           "cpu_ms_per_request": {r["process"]: round(1000 * r["cpu_s"] / (s["completed"] + min(8, concurrency)), 3)
                                  for r in cpu["by_process"] if r["cpu_s"] >= 0.05}}
    print(f"  c={concurrency:4d}: {row['requests_per_s']:7.1f} req/s {row['output_tokens_per_s']:8.1f} tok/s "
          f"(failed {row['failed']}, TTFT p50 {row['ttft_p50_ms']:.0f} ms)")
    print(format_cpu_table(cpu))
    if profile_to is not None and profile_to.exists():
        collapsed = profile_to.read_text()
        row["ingress_profile"] = {"leaf": top_frames(collapsed, 15), "inclusive": inclusive_frames(collapsed, 30)}
    return row


def _pct(result: dict[str, Any], key: str, q: int) -> float:
    values = sorted(r[key] for r in result["requests"] if r["success"])
    return 1000 * values[min(len(values) - 1, len(values) * q // 100)] if values else float("nan")


def run_layout(num_replicas: int, ingress: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every concurrency level on one deployment: ``ingress`` ingress replicas with ``num_replicas`` engines each
    (on a fresh cluster of simulated nodes with ``--nodes``: Serve keeps the first deployment's HTTP port)."""
    cluster = SimulatedNodes(args.nodes, args.node_cpus) if args.nodes else None
    try:
        return _run_layout(num_replicas, ingress, args, cluster)
    finally:
        if cluster is not None:
            cluster.shutdown()


def _run_layout(num_replicas: int, ingress: int, args: argparse.Namespace,
                cluster: SimulatedNodes | None) -> list[dict[str, Any]]:
    # a simulated worker sleeps: a tenth of a CPU each lets 4 replicas' workers fit on a 2-core Ray node
    app: dict[str, Any] = {"model": "sim", "num_replicas": num_replicas, "max_num_seqs": args.max_num_seqs,
                           "max_model_len": 2048, "worker_num_cpus": 0.1}
    if ingress > 1:
        app["autoscaling"] = {"min_replicas": ingress, "max_replicas": ingress, "initial_replicas": ingress}
    rows = []
    print(f"ingress replicas={ingress}, engine replicas each={num_replicas}"
          + (f", {args.nodes} simulated nodes" if cluster else ""))
    address = cluster.address if cluster is not None else "local"
    with local_deployment_process(app, timeout_s=300, log_path=args.out / "server.log",
                                  ray_address=address) as (base_url, proc):
        placement = cluster.ingress_nodes() if cluster is not None else {}
        if placement:
            print(f"  ingress replicas per node: {placement}")
        root = os.getpid() if cluster is not None else proc.pid  # a cluster's raylets are this process's children
        for c in args.concurrency:
            profile = args.out / f"ingress_i{ingress}_r{num_replicas}_c{c}.txt" if args.profile and c == max(
                args.concurrency) else None
            rows.append({"num_replicas": num_replicas, "ingress_replicas": ingress, "nodes": args.nodes,
                         "ingress_per_node": placement, **one_run(base_url, root, c, args, profile)})
    return rows


class SimulatedNodes:
    """A Ray cluster of simulated nodes on this machine: a head without CPUs (Serve's controller and proxy) and
    ``nodes`` nodes of ``cpus`` logical CPUs each."""

    def __init__(self, nodes: int, cpus: int) -> None:
        from ray.cluster_utils import Cluster

        from cbserve.bench.deploy import free_port

        self.dashboard_url = f"http://127.0.0.1:{free_port()}"
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "num_gpus": 0, "include_dashboard": True,
            "dashboard_port": int(self.dashboard_url.rsplit(":", 1)[1]), "gcs_server_port": free_port(),
            "dashboard_agent_listen_port": free_port(), "object_store_memory": 100 * 1024**2})
        for _ in range(nodes):
            self.cluster.add_node(num_cpus=cpus, object_store_memory=100 * 1024**2)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def ingress_nodes(self) -> dict[str, int]:
        """Ingress replicas per node (node ids shortened), from Ray's state API."""
        from ray.util.state import list_actors

        actors = list_actors(address=self.dashboard_url, filters=[("state", "=", "ALIVE")], limit=10_000)
        counts: dict[str, int] = {}
        for a in actors:
            if a.class_name.startswith("ServeReplica:") and a.class_name.endswith(":OpenAIIngress"):
                counts[a.node_id[:8]] = counts.get(a.node_id[:8], 0) + 1
        return counts

    def shutdown(self) -> None:
        self.cluster.shutdown()


def plot(rows: list[dict[str, Any]], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, r in sorted({(row["ingress_replicas"], row["num_replicas"]) for row in rows}):
        mine = [row for row in rows if (row["ingress_replicas"], row["num_replicas"]) == (k, r)]
        xs = [row["concurrency"] for row in mine]
        label = f"{k} ingress x {r} engine replica(s)"
        axes[0].plot(xs, [row["requests_per_s"] for row in mine], marker="o", label=label)
        axes[1].plot(xs, [row["output_tokens_per_s"] for row in mine], marker="o", label=label)
    for ax, what in zip(axes, ("requests/s", "streamed tokens/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients in flight")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    where = f"{rows[0]['nodes']} simulated nodes" if rows[0]["nodes"] else "one Ray node"
    fig.suptitle(f"model sim (H100 Llama-3-8B cost model), {where}\n{machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = describe(native.supported_levels()[0]).rsplit(",", 1)[0] + f", {len(os.sched_getaffinity(0))} cores"
    started = time.time()
    rows = [row for k in args.ingress_replicas for r in args.replicas for row in run_layout(r, k, args)]
    doc = {"machine": machine, "cores": len(os.sched_getaffinity(0)), "wall_s": time.time() - started,
           "nodes": args.nodes, "node_cpus": args.node_cpus if args.nodes else None,
           "workload": {"input_words": args.input_words, "output_tokens": args.output_tokens,
                        "requests_per_run": args.requests, "endpoint": "completions (streamed)"},
           "runs": rows}
    stem = f"sim_scaling_{args.nodes}nodes" if args.nodes else "sim_scaling"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    plot(rows, args.out / f"{stem}.png", machine)
    print(f"wrote {args.out / stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
