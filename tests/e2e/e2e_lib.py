"""Helpers shared by the end-to-end tests: free ports, polling, the Ray instance and Serve that modules share
(``SharedRay``; conftest.py's ``shared_ray``), and the cut-down SmolLM2 that splits over two tensor-parallel
ranks."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cbserve.bench.deploy import free_port as deploy_free_port


def free_port() -> int:
    """A port outside the kernel's ephemeral range (cbserve.bench.deploy.free_port): Ray's start-up cannot
    take it between this pick and the server binding it."""
    return deploy_free_port()


# Actors at niceness 0, as in the Ray instance ``cbserve serve`` starts (cluster/ops/node_tuning.py's engine-first
# profile), not Ray's 15: the engines then are not behind Ray's daemons, the test process and whatever else the
# machine runs (at 15 a neighbour at 0 takes nearly all of a core from them, and their steps outran the timeouts).
RAY_ENV = {"RAY_worker_niceness": "0"}


@contextlib.contextmanager
def ray_env() -> Iterator[None]:
    """``RAY_ENV`` in ``os.environ`` while the block starts Ray's processes (a value already there wins)."""
    from cbserve.cluster.ops.node_tuning import environment_for_ray

    with environment_for_ray(RAY_ENV):
        yield


class SharedRay:
    """A local Ray instance with Serve (HTTP on a free port) that end-to-end modules share, one after the other: started
    when an app first needs it (``start``), stopped (Serve first, then Ray) by ``stop``. Each module's apps come and
    go with ``apps``; the next module starts from a Serve instance without them, their engines and their stores."""

    def __init__(self, num_cpus: int = 4, namespace: str | None = None, object_store_mb: int | None = None) -> None:
        self.num_cpus, self.namespace, self.object_store_mb = num_cpus, namespace, object_store_mb
        self.url: str | None = None
        self.leaving: list[str] = []  # apps removed, not yet seen gone (``settle``)

    def start(self) -> str:
        """The Serve instance's base URL, Ray and Serve started first unless they run; the apps removed before are
        gone (``settle``)."""
        import ray
        from ray import serve

        if self.url is not None:
            self.settle()
        else:
            store = None if self.object_store_mb is None else self.object_store_mb * 1024**2
            with ray_env():
                ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False, namespace=self.namespace,
                         object_store_memory=store)  # fmt: skip
            port = free_port()
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
            except BaseException:
                ray.shutdown()
                raise
            self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        """Serve, then Ray (Serve's client would otherwise outlive its Ray session and meet the next one)."""
        import ray
        from ray import serve

        if self.url is not None:
            self.url, self.leaving = None, []
            try:
                serve.shutdown()
            finally:
                ray.shutdown()

    @contextlib.contextmanager
    def apps(
        self, apps: dict[str, dict[str, Any]], prefixes: dict[str, str] | None = None, ready_s: float = 240,
        meanwhile: Callable[[], Any] | None = None,
    ) -> Iterator[str]:
        """A cbserve app per entry of ``apps`` (name -> args) at its prefix (``prefixes``; default ``/{name}``);
        yields the base URL once every app's /health answers (within ``ready_s``), and removes the apps after
        (``remove``). ``meanwhile`` (offline references, say) runs in this process while the apps start: their
        start waits on Serve's control loop and on process spawns as much as on the CPU."""
        from ray import serve
        from ray.serve.api import RunTarget

        from cbserve.cluster.app import build_app

        url = self.start()
        routes = {name: (prefixes or {}).get(name, f"/{name}") for name in apps}
        try:
            serve.run_many([RunTarget(build_app(args), name=name, route_prefix=routes[name])
                            for name, args in apps.items()], wait_for_applications_running=False)  # fmt: skip
            if meanwhile is not None:
                meanwhile()
            for route in routes.values():
                health = url + route.rstrip("/") + "/health"
                wait_for(health, lambda h=health: urllib.request.urlopen(h, timeout=5).status == 200, ready_s)
            yield url
        finally:
            self.remove(list(apps))

    def remove(self, names: list[str]) -> None:
        """Starts deleting the apps ``names`` (those deployed), all at once; the next ``start`` waits for them to go
        (``settle``), so that the next module's set-up before its apps (models, offline references) overlaps the
        seconds Serve takes to stop them and their engines."""
        from ray import serve

        if self.url is not None:
            for name in names:
                serve.delete(name, _blocking=False)
            self.leaving += names

    def settle(self) -> None:
        """Returns once the apps removed are gone, then what they leave, as ``cbserve serve`` removes it (the response
        and LoRA stores), and none of their engine actors is alive."""
        from ray import serve

        from cbserve.cluster.stores.lora_store import remove_store
        from cbserve.cluster.stores.response_store import remove_response_store

        names, self.leaving = self.leaving, []
        if not names:
            return
        wait_for(f"the apps {names} deleted", lambda: not set(names) & set(serve.status().applications), 120)
        for name in names:
            remove_response_store(name)
            remove_store(name)
        wait_for(f"the engines and stores of {names} gone", lambda: not _named_actors_of(names), 60)


def _named_actors_of(apps: list[str]) -> list[str]:
    """The live named actors of ``apps`` in cbserve's namespace: their engines and their stores (a store is named
    after its app: a later app of the same name would otherwise find the one that is being killed)."""
    import ray

    from cbserve.cluster.ops.names import NAMESPACE
    from cbserve.cluster.stores.lora_store import store_name as lora_store_name
    from cbserve.cluster.stores.response_store import store_name as response_store_name

    stores = {f(app) for app in apps for f in (lora_store_name, response_store_name)}
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE
            and (a["name"] in stores or any(a["name"].startswith(f"{app}:") for app in apps))]  # fmt: skip


@contextlib.contextmanager
def local_serve_app(args: dict[str, Any], name: str) -> Iterator[str]:
    """A local Ray of its own (4 CPUs) serving cbserve's app built from ``args`` at ``/`` on a free port; yields its
    URL once /health answers, shuts Serve and Ray down after."""
    with local_serve_apps({name: args}, prefixed=False) as url:
        yield url


@contextlib.contextmanager
def local_serve_apps(apps: dict[str, dict[str, Any]], prefixed: bool = True) -> Iterator[str]:
    """A local Ray of its own (4 CPUs) serving a cbserve app per entry of ``apps`` (name -> args), each under
    ``/{name}`` (at ``/`` when not ``prefixed``: one app); yields the base URL once every app's /health answers,
    shuts Serve and Ray down after. (The end-to-end modules share conftest.py's ``shared_ray`` instead.)"""
    cluster = SharedRay()
    try:
        with cluster.apps(apps, None if prefixed else dict.fromkeys(apps, "/")) as url:
            yield url
    finally:
        cluster.stop()


def post_text(url: str, body: dict[str, Any]) -> tuple[int, str]:
    """The status and text of a JSON POST (the LoRA adapter routes answer success as text, errors as JSON)."""
    import urllib.error

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_for(what: str, cond: Callable[[], Any], timeout: float, period: float = 0.2) -> Any:
    """Poll ``cond`` until it returns something true (exceptions count as "not yet"); TimeoutError after."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
            if last:
                return last
        except Exception as e:  # not there yet
            last = e
        time.sleep(period)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def derive_tp2_model(dst: Path, num_layers: int = 4, num_kv_heads: int = 2) -> Path:
    """The bundled SmolLM2-135M with its first ``num_layers`` layers and its first ``num_kv_heads`` KV heads
    (with their query heads): 6 heads and 2 KV heads divide by a tensor-parallel size of 2."""
    import torch
    from safetensors.torch import save_file

    from cbserve.worker.loading.model_loader import iter_weights, resolve_model

    src = resolve_model(None).folder
    cfg = json.loads((src / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q_rows = num_kv_heads * (cfg["num_attention_heads"] // cfg["num_key_value_heads"]) * head_dim
    kv_rows = num_kv_heads * head_dim
    state: dict[str, torch.Tensor] = {}
    for name, t in iter_weights(src, progress=False):
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        if name.endswith("q_proj.weight"):
            t = t[:q_rows]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            t = t[:kv_rows]
        elif name.endswith("o_proj.weight"):
            t = t[:, :q_rows]
        state[name] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(
        num_hidden_layers=num_layers,
        num_attention_heads=q_rows // head_dim,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
    )
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return dst
