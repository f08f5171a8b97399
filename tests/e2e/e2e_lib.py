"""Helpers shared by the end-to-end tests: free ports, polling, and the cut-down SmolLM2 that splits over
two tensor-parallel ranks."""

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


@contextlib.contextmanager
def local_serve_app(args: dict[str, Any], name: str) -> Iterator[str]:
    """A local Ray (4 CPUs) serving cbserve's app built from ``args`` on a free port; yields its URL once
    /health answers, shuts Serve and Ray down after."""
    with local_serve_apps({name: args}, prefixed=False) as url:
        yield url


@contextlib.contextmanager
def local_serve_apps(apps: dict[str, dict[str, Any]], prefixed: bool = True) -> Iterator[str]:
    """One local Ray (4 CPUs) serving a cbserve app per entry of ``apps`` (name -> args), each under ``/{name}``
    (at ``/`` when not ``prefixed``: one app); yields the base URL once every app's /health answers."""
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from cbserve.cluster.app import build_app

    ray.init(address="local", num_cpus=4, include_dashboard=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        prefixes = {name: f"/{name}" if prefixed else "/" for name in apps}
        serve.run_many([RunTarget(build_app(args), name=name, route_prefix=prefixes[name])
                        for name, args in apps.items()], wait_for_applications_running=False)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        for prefix in prefixes.values():
            health = url + prefix.rstrip("/") + "/health"
            wait_for(f"{health}", lambda h=health: urllib.request.urlopen(h, timeout=5).status == 200, 240)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


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
