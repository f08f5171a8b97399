"""cbserve on a simulated multi-node Ray cluster: several raylets on this machine (ray.cluster_utils).

The head node advertises no CPU and no GPU, like the head of deploy/cluster.yaml: it hosts the Serve
controller, the HTTP proxy, the ingress and the engine schedulers (all zero-CPU actors). Two "GPU nodes"
declare 2 GPUs and 2 CPUs each. The app is deployed the way docs/deployment.md says, with `serve deploy`
of deploy/serve.yaml (args adapted to CPU), as 2 engine replicas of tensor-parallel size 2:

- each replica's two WorkerActors share one node (STRICT_PACK), and the two replicas use both nodes;
- both replicas answer through the HTTP ingress (openai client) with the greedy output of the offline
  ``LLM`` class;
- removing one node leaves the other replica serving; adding a node back gets the lost replica rebuilt
  there and serving again.

The model runs on CPU, so the worker actors' placement currency is CPU (``worker_num_cpus``): cbserve
requests a GPU per rank only when ``device`` is cuda. The model is the bundled SmolLM2-135M cut down to
4 layers and 6 of its 9 attention heads (2 of 3 KV heads), so that it splits over 2 ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_lib import derive_tp2_model, free_port, ray_env, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
APP = "cbserve"
MODEL_NAME = "smollm2-tp2"
HEAD_RESOURCE = "cbserve_test_head"
GPU_NODE = {"num_cpus": 2, "num_gpus": 2, "object_store_memory": 100 * 1024**2}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is"]
MAX_TOKENS = 12


def _app_args(model: Path) -> dict[str, Any]:
    """deploy/serve.yaml's args, adapted to this machine (CPU, a tiny model, small memory)."""
    serve_yaml = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    args = dict(serve_yaml["applications"][0]["args"])
    args.update(
        model=str(model),
        served_model_name=MODEL_NAME,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        num_replicas=2,
        max_model_len=256,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=16 * 1024**2,
        worker_num_cpus=1,
        worker_torch_threads=1,
    )
    return args


def _serve_config(args: dict[str, Any], http_port: int) -> dict[str, Any]:
    serve_yaml = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    app = dict(serve_yaml["applications"][0], args=args)
    # Pin the ingress to the head (as on a real cluster, where worker nodes have no spare CPU for it):
    # the test removes GPU nodes and wants the HTTP entry point to survive.
    app["deployments"] = [
        {"name": "OpenAIIngress", "ray_actor_options": {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.01}}}
    ]
    return {
        "proxy_location": "HeadOnly",  # every raylet here shares one host and so one port space
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [app],
    }


@pytest.fixture(scope="module")
def tp2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return derive_tp2_model(tmp_path_factory.mktemp("model") / MODEL_NAME)


@pytest.fixture(scope="module")
def expected(tp2_model: Path) -> dict[str, str]:
    """Greedy output of the offline LLM class (one process, no tensor parallelism)."""
    import torch

    from cbserve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model=str(tp2_model), device="cpu", dtype="float32", kv_cache_memory_bytes=16 * 1024**2,
              max_model_len=256, progress=False)  # fmt: skip
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    llm.shutdown()
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


class Deployment:
    """A running simulated cluster with the app deployed, and helpers to inspect it."""

    def __init__(self, cluster: Any, http_port: int, dashboard_url: str) -> None:
        self.cluster = cluster
        self.dashboard_url = dashboard_url
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        self.head_id = cluster.head_node.node_id

    def http_get(self, path: str) -> tuple[int, Any]:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.base_url + path, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def healthy(self) -> bool:
        return self.http_get("/health")[0] == 200

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        return {r["replica"]: r for r in self.http_get("/stats")[1]["replicas"]}

    def complete(self, prompt: str, retry_for: float = 0.0) -> str:
        """Greedy completion; with ``retry_for``, retry 503s and broken connections that long."""
        deadline = time.monotonic() + retry_for
        while True:
            try:
                r = self.client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
                )
                return r.choices[0].text
            except (openai.InternalServerError, openai.APIConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def complete_all(self, prompts: list[str], retry_for: float = 0.0) -> dict[str, str]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = pool.map(lambda p: self.complete(p, retry_for), prompts)
            return dict(zip(prompts, texts, strict=True))

    def placement(self) -> dict[str, dict[int, str]]:
        """replica -> {rank: node id} of the live WorkerActors (from the engines' own worker handles)."""
        from ray.util.state import list_actors

        from cbserve.cluster.ops.names import NAMESPACE, engine_actor_names

        filters = [("class_name", "=", "WorkerActor"), ("state", "=", "ALIVE")]
        node_of_pid = {a.pid: a.node_id for a in list_actors(address=self.dashboard_url, filters=filters)}
        out: dict[str, dict[int, str]] = {}
        names = engine_actor_names(APP)
        assert len(names) == 2, names
        for name in names:
            engine = ray.get_actor(name, namespace=NAMESPACE)
            handles = ray.get(engine.worker_handles.remote(), timeout=30)
            for ping in ray.get([h.ping.remote() for h in handles], timeout=30):
                out.setdefault(ping["replica"], {})[ping["rank"]] = node_of_pid[ping["pid"]]
                assert ping["torch_threads"] == 1  # worker_torch_threads
        return out

    def scheduler_nodes(self) -> set[str]:
        from ray.util.state import list_actors

        filters = [("class_name", "=", "SchedulerActor"), ("state", "=", "ALIVE")]
        actors = list_actors(address=self.dashboard_url, filters=filters)
        return {a.node_id for a in actors}


@pytest.fixture(scope="module")
def deployment(tp2_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with ray_env():  # its raylets start actors at niceness 0 (e2e_lib.RAY_ENV), the one added back later too
        yield from _deployment(tp2_model, tmp_path_factory)


def _deployment(tp2_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from ray.cluster_utils import Cluster

    http_port, dashboard_port = free_port(), free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "num_gpus": 0,
            "resources": {HEAD_RESOURCE: 1},
            "gcs_server_port": free_port(),
            "dashboard_port": dashboard_port,
            "dashboard_agent_listen_port": free_port(),
            "include_dashboard": True,
            "object_store_memory": 100 * 1024**2,
        },
    )
    try:
        for _ in range(2):
            cluster.add_node(**GPU_NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="cbserve-test-multinode")
        config = tmp_path_factory.mktemp("serve") / "serve.yaml"
        config.write_text(yaml.safe_dump(_serve_config(_app_args(tp2_model), http_port)))
        serve_cli = Path(sys.executable).with_name("serve")
        subprocess.run(  # exactly what docs/deployment.md tells operators to run
            [str(serve_cli), "deploy", str(config), "--address", f"http://127.0.0.1:{dashboard_port}"],
            check=True, timeout=120, capture_output=True,
        )  # fmt: skip
        d = Deployment(cluster, http_port, f"http://127.0.0.1:{dashboard_port}")
        wait_for("the app to be healthy", d.healthy, timeout=180)
        yield d
    finally:
        try:
            if ray.is_initialized():
                from ray import serve

                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_tp_groups_packed_per_node_and_replicas_spread(deployment: Deployment) -> None:
    placement = deployment.placement()
    assert sorted(placement) == ["0", "1"]
    gpu_nodes = {n.node_id for n in deployment.cluster.worker_nodes}
    used = []
    for replica, ranks in placement.items():
        assert sorted(ranks) == [0, 1], f"replica {replica} lacks a rank: {ranks}"
        nodes = set(ranks.values())
        assert len(nodes) == 1, f"replica {replica}'s TP group spans nodes {nodes} (STRICT_PACK)"
        assert nodes <= gpu_nodes, f"replica {replica}'s workers are not on a GPU node"
        used += nodes
    assert len(set(used)) == 2, "the two replicas should occupy the two GPU nodes"
    # the zero-CPU engine schedulers stay on the head with the ingress (their creator)
    assert deployment.scheduler_nodes() == {deployment.head_id}


def test_both_replicas_serve_greedy_output_of_offline_llm(
    deployment: Deployment, expected: dict[str, str]
) -> None:
    before = {k: v["num_admitted"] for k, v in deployment.replica_stats().items()}
    assert deployment.complete_all(PROMPTS) == expected
    after = {k: v["num_admitted"] for k, v in deployment.replica_stats().items()}
    assert all(after[r] > before[r] for r in ("0", "1")), f"not every replica served: {before} -> {after}"


def test_node_loss_keeps_serving_and_lost_replica_returns(
    deployment: Deployment, expected: dict[str, str]
) -> None:
    placement = deployment.placement()
    lost_replica = "1"
    lost_node_id = placement[lost_replica][0]
    survivor = "0"
    node = next(n for n in deployment.cluster.worker_nodes if n.node_id == lost_node_id)
    generation = deployment.replica_stats()[lost_replica]["generation"]

    deployment.cluster.remove_node(node, allow_graceful=False)
    t0 = time.monotonic()
    served = deployment.replica_stats()[survivor]["num_admitted"]
    # A request routed to the lost replica before anyone noticed fails with 503; clients retry those.
    assert deployment.complete_all(PROMPTS, retry_for=90) == expected
    print(f"served after node loss in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    stats = deployment.replica_stats()
    # The survivor took load. Not necessarily all of it: the lost node's worker process outlives its raylet
    # for a moment, and a step it finishes then still completes its requests (correctly) on the lost replica.
    assert stats[survivor]["num_admitted"] > served
    # Noticed, though maybe only after the requests completed (when its worker outlived the raylet long enough).
    wait_for("the lost replica noticed", lambda: deployment.replica_stats()[lost_replica]["state"] != "ready", 60)

    new_node = deployment.cluster.add_node(**GPU_NODE)
    wait_for("the lost replica to be rebuilt", deployment.healthy, timeout=180)
    stats = deployment.replica_stats()
    assert stats[lost_replica]["generation"] > generation
    placement = deployment.placement()
    assert set(placement[lost_replica].values()) == {new_node.node_id}
    assert set(placement[survivor].values()) != {lost_node_id}
    before = stats[lost_replica]["num_admitted"]
    wait_for(
        "the rebuilt replica to serve",
        lambda: deployment.complete_all(PROMPTS) == expected
        and deployment.replica_stats()[lost_replica]["num_admitted"] > before,
        timeout=60,
    )
