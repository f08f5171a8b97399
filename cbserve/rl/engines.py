"""A trainer's handle on the engines of a served app: ``RolloutEngines(app_name)`` finds every engine replica of
the app (those of all its ingress replicas, by their actor names: cluster/ops/names.py) and runs the RL loop's
controls on all of them at once (cluster/engine/rollout.py): pause / resume, sleep / wake_up, reset_prefix_cache,
update_weights, through the Ray object store (``update_weights``) or through a weight group the trainer leads
(``init_weight_transfer`` then ``update_weights_from_group``: rl/weight_sync.py). The trainer must be in the app's
Ray cluster (a Ray actor or driver); the HTTP routes of the same controls are the ingress's (/pause, /sleep, ...).

    engines = RolloutEngines("default")
    engines.update_weights(model.state_dict())          # HF names; every replica, every rank; version + 1
    engines.pause("keep"); ...; engines.resume()

``AppEngines`` is the same fan-out for async callers (the ingress's routes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import ray

from cbserve.cluster.ops.names import NAMESPACE, engine_actor_names

Weights = Mapping[str, Any] | Iterable[tuple[str, Any]]


class AppEngines:
    """Every engine replica of ``app_name``; ``call`` runs one of their Ray methods on all of them."""

    def __init__(self, app_name: str) -> None:
        names = engine_actor_names(app_name)
        if not names:
            raise RuntimeError(f"no engine replica of app {app_name!r} runs in this Ray cluster (is it served?)")
        self.app_name = app_name
        self.actors = [ray.get_actor(name, namespace=NAMESPACE) for name in names]

    def refs(self, method: str, *args: Any) -> list[Any]:
        return [getattr(actor, method).remote(*args) for actor in self.actors]

    async def call(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*self.refs(method, *args)))


class RolloutEngines:
    """The engines of a served app, for a trainer (blocking calls). Every method runs on every replica and returns
    their answers in replica order."""

    def __init__(self, app_name: str = "default", timeout_s: float = 600.0) -> None:
        self.engines = AppEngines(app_name)
        self.timeout_s = timeout_s
        self.group: Any = None  # the weight group this trainer leads (rank 0), after init_weight_transfer

    def _all(self, method: str, *args: Any) -> list[Any]:
        return list(ray.get(self.engines.refs(method, *args), timeout=self.timeout_s))

    # ---- pause, sleep, prefix cache ---------------------------------------------------------------
    def pause(self, mode: str = "keep") -> list[dict[str, Any]]:
        return self._all("pause", mode)

    def resume(self) -> list[dict[str, Any]]:
        return self._all("resume")

    def is_paused(self) -> bool:
        return any(s["paused"] for s in self.state())

    def sleep(self, level: int = 1) -> list[dict[str, Any]]:
        return self._all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> list[dict[str, Any]]:
        return self._all("wake_up", tags)

    def is_sleeping(self) -> bool:
        return any(s["sleeping"] for s in self.state())

    def reset_prefix_cache(self) -> list[dict[str, Any]]:
        return self._all("reset_prefix_cache")

    def state(self) -> list[dict[str, Any]]:
        """Per replica: tensor-parallel size, ready, paused, what sleeps, the weights' version."""
        return self._all("rollout_state")

    # ---- weights ----------------------------------------------------------------------------------
    def next_version(self) -> int:
        return 1 + max(s["weights_version"] for s in self.state())

    def update_weights(self, weights: Weights, version: int | None = None) -> list[dict[str, Any]]:
        """Push HF-named tensors (all of the model's or some) to every rank through the object store (one
        ``ray.put``, fetched by each rank); applied between two steps. ``version``: default the newest + 1."""
        from cbserve.rl.weight_sync import named_tensors

        ref = ray.put(named_tensors(weights))
        version = self.next_version() if version is None else version
        return self._all("update_weights", [ref], version)

    def init_weight_transfer(self, backend: str = "gloo", host: str | None = None, port: int | None = None,
                             timeout_s: float = 300.0) -> None:
        """Form the weight group: this trainer (rank 0, hosting its store at ``host``:``port``, default this node's
        address and a free port) and every rank of every replica. ``backend``: "gloo" (CPU) or "nccl" (CUDA)."""
        from cbserve.rl.weight_sync import WeightGroup, WeightTransferInfo, free_port

        host = host or ray.util.get_node_ip_address()
        port = port or free_port(host)
        tps = [s["tensor_parallel_size"] for s in self.state()]
        infos = WeightTransferInfo.for_replicas(host, port, tps, backend, timeout_s)
        pairs = zip(self.engines.actors, infos, strict=True)
        joined = [actor.init_weight_transfer.remote(info) for actor, info in pairs]
        if self.group is not None:
            self.group.close()
        self.group = WeightGroup.open(host, port, 0, infos[0].world_size, backend, timeout_s)
        ray.get(joined, timeout=timeout_s)

    def update_weights_from_group(self, weights: Weights, version: int | None = None,
                                  bucket_bytes: int | None = None) -> list[dict[str, Any]]:
        """Broadcast HF-named tensors on the weight group (``init_weight_transfer`` first); applied between two
        steps, like ``update_weights``."""
        if self.group is None:
            raise RuntimeError("init_weight_transfer first: this trainer leads no weight group")
        version = self.next_version() if version is None else version
        from cbserve.rl.weight_sync import named_tensors

        applied = self.engines.refs("update_weights", None, version)
        pairs = named_tensors(weights)
        if bucket_bytes is None:
            self.group.send(pairs)
        else:
            self.group.send(pairs, bucket_bytes)
        return list(ray.get(applied, timeout=self.timeout_s))

    def load_lora_adapter(self, name: str, weights: Weights, config: Any, load_inplace: bool = True) -> dict[str, Any]:
        """Serve a LoRA adapter the trainer holds (PEFT's names and tensors, ``get_peft_model_state_dict``, and its
        ``LoraConfig``) as ``name`` on every replica of the app, replacing the one of that name (``load_inplace``):
        requests sent after it run the new adapter, those in flight finish with the old (the app needs
        ``enable_lora``). Returns its ``lora_name``, new ``lora_int_id`` and ``digest``."""
        from ray import serve

        from cbserve.rl.adapters import adapter_content

        handle = serve.get_app_handle(self.engines.app_name)
        content = adapter_content(weights, config)
        return handle.load_lora_content.remote(name, content, load_inplace).result(timeout_s=self.timeout_s)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
