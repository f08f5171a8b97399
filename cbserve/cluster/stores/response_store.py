"""The Responses API's store for the whole app: a response stored with ``store: true`` through one ingress replica is
read, chained (``previous_response_id``) and deleted through any other, and outlives the replica that stored it
(autoscaling, a restart, a rolling update).

One detached actor per app (``ResponseStoreActor``, named ``response-store:<app>`` in namespace ``cbserve``, as the
LoRA adapters' store) holds the entries in a ``frontend/responses/store.py:ResponseStore``: at most
``responses_store_max_entries`` (the least recently used out first), none older than ``responses_store_ttl_s``.
Each replica reaches it through ``SharedResponses``, the front end's ``StoredResponses``: one actor call per
store, read or delete. Ray restarts the actor if its process dies (its entries are lost then: a GET answers 404);
``cbserve serve`` removes it with the app. An entry travels pickled, its whole conversation included."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray

from cbserve.cluster.ops.names import NAMESPACE
from cbserve.frontend.protocol import APIError
from cbserve.frontend.responses.store import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)


def store_name(app_name: str) -> str:
    return f"response-store:{app_name}"


@ray.remote(num_cpus=0, max_restarts=-1)
class ResponseStoreActor:
    """The app's stored responses (one ``ResponseStore``); its methods run one at a time."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.store = ResponseStore(max_entries, ttl_s)

    def configure(self, max_entries: int, ttl_s: float) -> None:
        """The bounds of the app's configuration (every replica sends its own at start: a new version's win)."""
        self.store.configure(max_entries, ttl_s)

    def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    def put(self, entry: StoredResponse) -> None:
        self.store.put(entry)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    def size(self) -> int:
        return len(self.store)


def remove_response_store(app_name: str) -> None:
    """End the app's store, if it has one (with the app: ``cbserve serve``'s shutdown)."""
    with contextlib.suppress(ValueError):  # ValueError: no replica of the app ever started
        ray.kill(ray.get_actor(store_name(app_name), namespace=NAMESPACE))


class SharedResponses:
    """One ingress replica's side of the app's store (``StoredResponses``). An unreachable store (its process
    restarting) answers a read or delete with a 503; a response it could not keep is answered all the same, and
    the failure logged."""

    def __init__(self, app_name: str, max_entries: int, ttl_s: float) -> None:
        self.actor: Any = ResponseStoreActor.options(name=store_name(app_name), namespace=NAMESPACE,  # type: ignore[attr-defined]
                                                     lifetime="detached", get_if_exists=True,
                                                     ).remote(max_entries, ttl_s)  # fmt: skip
        self.actor.configure.remote(max_entries, ttl_s)  # a store the app had before this version: its bounds

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._call(self.actor.get, response_id)  # type: ignore[no-any-return]

    async def put(self, entry: StoredResponse) -> None:
        try:
            await self.actor.put.remote(entry)
        except Exception as e:
            logger.warning("response %s not stored: the response store is not reachable (%s: %s)",
                           entry.response.id, type(e).__name__, e)  # fmt: skip

    async def delete(self, response_id: str) -> bool:
        return await self._call(self.actor.delete, response_id)  # type: ignore[no-any-return]

    async def _call(self, method: Any, *args: Any) -> Any:
        try:
            return await method.remote(*args)
        except Exception as e:
            logger.warning("response store not reachable (%s: %s)", type(e).__name__, e)
            raise APIError(503, "the response store is not reachable; retry the request",
                           "service_unavailable") from e  # fmt: skip
