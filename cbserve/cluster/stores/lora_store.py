"""LoRA adapters shared by every ingress replica of an app: a load or unload answered by any replica reaches
all of them, and a replica started later (autoscaling, a restart) serves the same set.

One detached actor per app (``LoRAStore``, named ``lora-store:<app>``) keeps the adapters' names and ids: it
decides name conflicts and hands out ids, so two replicas never give one name two ids. A replica reads and checks
an adapter whole itself (a 400 with the reason, ``frontend/lora_registry.py``), asks the store to register or
unregister the name with the bytes it checked, mirrors the store's answer (an ``AdapterSet``) at once and
broadcasts it to the other replicas through Serve; each also pulls the store every ``PULL_PERIOD_S``, which
covers a replica that was starting during a broadcast. The store outlives scale-to-zero and is removed with the
app (``cbserve serve``).

The store also keeps each adapter's checked bytes, by digest (``frontend/lora_contents.py``: those of the
adapters served, and of the last ``KEEP_UNLOADED`` unloaded ones, for requests still running with them). The
workers run exactly those: a worker's ``LoRAManager`` gets them through ``StoreAdapterSource`` (by the digest its
``LoRARequest`` names), so a file changed or deleted after its adapter was loaded never reaches a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import ray

from cbserve.cluster.ops.names import NAMESPACE
from cbserve.frontend.lora_registry import (
    AdapterSet,
    CheckedAdapter,
    LoadLoRAAdapterRequest,
    LoRARegistry,
    UnloadLoRAAdapterRequest,
    loaded_message,
    unloaded_message,
)
from cbserve.frontend.protocol import APIError
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.worker.lora.files import AdapterContent, LoRAAdapterError

logger = logging.getLogger(__name__)

PULL_PERIOD_S = 5.0
FETCH_TIMEOUT_S = 120.0  # a worker's wait for an adapter's bytes from the store
_STORE_PREFIX = "lora-store:"


def store_name(app_name: str) -> str:
    return f"{_STORE_PREFIX}{app_name}"


@ray.remote(num_cpus=0)
class LoRAStore:
    """The app's adapters by name and their checked bytes by digest (a ``LoRARegistry``'s bookkeeping and
    contents; adapters are checked by the replicas). Refusals come back as the ``APIError`` value, for the
    replica to answer."""

    def __init__(self) -> None:
        self.served: tuple[str, str] | None = None  # (served model name, model path) the adapters belong to
        self.registry = LoRARegistry("")
        self.seeded: set[str] = set()  # the lora_modules names added once already

    def seed(self, base_name: str, model: str, modules: dict[str, CheckedAdapter]) -> AdapterSet:
        """Called by every replica at start: the adapters of ``lora_modules`` not seeded before are added (one
        unloaded while serving stays unloaded when a replica starts later); a store left by an app serving
        another model starts over."""
        if self.served != (base_name, model):
            old = self.registry.snapshot()
            self.registry = LoRARegistry(base_name)
            self.registry.apply(AdapterSet(old.version + 1, (), old.next_id))  # newer than any mirror of the old
            self.served, self.seeded = (base_name, model), set()
        served = {lora.lora_name for lora in self.registry.adapters()}
        for name, checked in modules.items():
            if name not in self.seeded and name not in served:
                self.registry.register(name, checked.folder, content=checked.content)
            self.seeded.add(name)
        return self.registry.snapshot()

    def snapshot(self) -> AdapterSet:
        return self.registry.snapshot()

    def register(self, name: str, folder: str, replace: bool, content: AdapterContent) -> AdapterSet | APIError:
        try:
            self.registry.register(name, folder, replace, content)
        except APIError as e:
            return e
        return self.registry.snapshot()

    def content(self, digest: str) -> tuple[bytes, bytes] | None:
        """An adapter's checked (config, weights) bytes; None when no longer kept (or never kept here)."""
        content = self.registry.contents.get(digest)
        return None if content is None else (content.config, content.weights)

    def unregister(self, name: str, lora_int_id: int | None) -> AdapterSet | APIError:
        try:
            self.registry.unregister(name, lora_int_id)
        except APIError as e:
            return e
        return self.registry.snapshot()


def remove_store(app_name: str) -> None:
    """End the app's store, if it has one (with the app: ``cbserve serve``'s shutdown)."""
    with contextlib.suppress(ValueError):  # ValueError: the app served no adapters
        ray.kill(ray.get_actor(store_name(app_name), namespace=NAMESPACE))


class SharedLoRAs:
    """One ingress replica's side of the store: ``registry`` (the front end's) mirrors it; ``broadcast`` sends a
    new ``AdapterSet`` to every replica of the app (``OpenAIIngress.sync_loras``)."""

    def __init__(self, registry: LoRARegistry, app_name: str, broadcast: Any) -> None:
        self.registry = registry
        self.broadcast = broadcast
        self.store = LoRAStore.options(name=store_name(app_name), namespace=NAMESPACE, lifetime="detached",
                                       get_if_exists=True).remote()  # fmt: skip
        self._pulled_at = 0.0
        self._pulling: asyncio.Task[None] | None = None

    async def start(self, model: str, modules: dict[str, CheckedAdapter]) -> None:
        """Serve the store's adapters, after adding ``modules`` (checked at start-up) to them."""
        self.registry.apply(await self.store.seed.remote(self.registry.base_name, model, modules))
        self._pulled_at = asyncio.get_running_loop().time()

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        # a 404 or 400 here, before the store; read and checked whole off the event loop
        checked = await asyncio.to_thread(self.registry.check_load, req)
        await self._change(self.store.register.remote(req.lora_name, checked.folder, req.load_inplace,
                                                      checked.content))
        logger.info("LoRA adapter %r loaded from %s (%s)", req.lora_name, checked.folder, checked.content.digest)
        return loaded_message(req.lora_name)

    async def load_content(self, name: str, content: AdapterContent, replace: bool) -> LoRARequest:
        """A trainer's adapter (bytes, ``rl/adapters.py``) served as ``name`` on every replica; its new id."""
        checked = await asyncio.to_thread(self.registry.check_content, name, content, replace)
        answer = await self._change(self.store.register.remote(name, checked.folder, replace, checked.content))
        lora = next(lora for lora in answer.adapters if lora.lora_name == name and lora.digest == content.digest)
        logger.info("LoRA adapter %r pushed as id %d (%s)", name, lora.lora_int_id, content.digest)
        return lora

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        self.registry.check_runtime()
        await self._change(self.store.unregister.remote(req.lora_name, req.lora_int_id))
        logger.info("LoRA adapter %r unloaded", req.lora_name)
        return unloaded_message(req.lora_name)

    async def _change(self, reply: Any) -> AdapterSet:
        """The store's answer to a change (the adapters it serves now), mirrored here and broadcast."""
        answer = await reply
        if isinstance(answer, APIError):
            await self.pull()  # this replica's mirror was behind (another replica changed the name)
            raise answer
        self.registry.apply(answer)
        try:
            await self.broadcast(answer)
        except Exception as e:  # a replica going away; the others pull the store within PULL_PERIOD_S
            logger.warning("LoRA adapters not broadcast to every replica (%s: %s)", type(e).__name__, e)
        return answer

    async def pull(self) -> None:
        self.registry.apply(await self.store.snapshot.remote())
        self._pulled_at = asyncio.get_running_loop().time()

    def tick(self) -> None:
        """The periodic pull (the replica's health tick calls it): one every ``PULL_PERIOD_S``, never two at once."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._pulled_at >= PULL_PERIOD_S and (self._pulling is None or self._pulling.done()):
            self._pulled_at = loop.time()
            self._pulling = loop.create_task(self._pull_quietly())

    async def _pull_quietly(self) -> None:
        try:
            await self.pull()
        except Exception as e:  # the store is being restarted or removed: next period
            logger.warning("LoRA store not reachable (%s: %s)", type(e).__name__, e)


class StoreAdapterSource:
    """A worker's adapter source (``LoRAManager(source=...)``): the checked bytes a ``LoRARequest``'s digest
    names, fetched from the app's store. Bytes are named by their digest (and the worker checks it), so when the
    app's store does not have them, another store of the cluster that does serves as well (a worker whose config
    names another app than the one Serve runs finds them so). LoRAAdapterError when no store keeps them."""

    def __init__(self, app_name: str, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.app_name, self.timeout_s = app_name, timeout_s

    def __call__(self, lora: LoRARequest) -> tuple[bytes, bytes]:
        if lora.digest is None:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r} names no checked content")
        mine = store_name(self.app_name)
        content = self._fetch(mine, lora.digest)
        for name in self._other_stores(mine) if content is None else ():
            content = self._fetch(name, lora.digest)
            if content is not None:
                break
        if content is None:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: its checked content is no longer kept "
                                   "(unloaded long ago?)")
        return content

    def _fetch(self, name: str, digest: str) -> tuple[bytes, bytes] | None:
        try:
            store = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # no such store
            return None
        return ray.get(store.content.remote(digest), timeout=self.timeout_s)

    @staticmethod
    def _other_stores(mine: str) -> list[str]:
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a.get("namespace") == NAMESPACE and a["name"].startswith(_STORE_PREFIX) and a["name"] != mine)
