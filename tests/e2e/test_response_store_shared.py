"""The Responses API's store is the app's, not an ingress replica's (cluster/stores/response_store.py): on a real
local Ray with two ingress replicas (``autoscaling: min=2,max=2``) of the simulated engine (``model: sim``) behind
Serve's proxy, responses stored through the proxy are read back through it, none answered 404; each replica reads
each of them (a Serve broadcast asks both: those the other stored included); once both replicas that stored them
are gone (killed; Serve starts new ones), the new replicas read them and chain on them; one deleted through a
replica is gone for all; the app's store is one named actor, removed with the app as ``cbserve serve`` removes it.
(Serve's proxy keeps sending an idle app's requests to one replica, so the test does not count on its spread.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e_lib import SharedRay, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

APP = "responses"
ARGS = {"model": "sim", "max_model_len": 1024, "autoscaling": "min=2,max=2", "node_tuning": "off",
        "responses_store_max_entries": 64}  # fmt: skip
STORED = 8  # responses stored through the proxy; each read also goes through it, to either replica


def _ingress_replicas() -> set[str]:
    """The actor names of the app's ingress replicas that are alive."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#OpenAIIngress" in a["name"]}


def _running() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    return int(app.deployments["OpenAIIngress"].replica_states.get("RUNNING", 0)) if app else 0


def _read_on_every_replica(response_id: str) -> list[Any]:
    """``GET /v1/responses/{id}`` as each ingress replica answers it (a Serve broadcast of the route's method): the
    stored response's id, or the error's status."""
    from ray import serve

    answers = serve.get_app_handle(APP).broadcast("get_response", response_id).results(timeout_s=60,
                                                                                       return_exceptions=True)
    return [getattr(a, "status", repr(a)) if isinstance(a, Exception) else json.loads(a.body)["id"] for a in answers]


def test_a_response_stored_through_one_ingress_replica_is_read_through_any_other(shared_ray: SharedRay) -> None:
    from ray import serve

    from cbserve.cluster.ops.names import NAMESPACE
    from cbserve.cluster.stores.response_store import remove_response_store, store_name

    with shared_ray.apps({APP: ARGS}, {APP: "/"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        # (the app answers once one replica runs; the test's handle learns of the second within seconds)
        wait_for("both ingress replicas answering", lambda: _read_on_every_replica("resp_none") == [404, 404], 180)
        ids = [client.responses.create(model="sim", input=f"Hello {i}!", max_output_tokens=4, store=True).id
               for i in range(STORED)]  # fmt: skip
        assert [client.responses.retrieve(rid).id for rid in ids] == ids  # none 404s, whichever replica reads it
        # each replica reads every response, those stored through the other one included
        assert [_read_on_every_replica(rid) for rid in ids] == [[rid, rid] for rid in ids]
        # the replicas that stored them go (Serve replaces them): the responses stay, read and chained on through
        # replicas that never stored one
        stored_by = _ingress_replicas()
        assert len(stored_by) == 2, stored_by
        for name in stored_by:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        wait_for("two new ingress replicas", lambda: _running() == 2 and not _ingress_replicas() & stored_by, 180)
        # (the test's handle and the proxy learn of the new replicas within seconds; a read meanwhile finds a dead one)
        wait_for("both new replicas answering", lambda: _read_on_every_replica(ids[0]) == [ids[0]] * 2, 60)
        assert [client.responses.retrieve(rid).id for rid in ids] == ids
        chained = [client.responses.create(model="sim", input="And then?", previous_response_id=rid,
                                           max_output_tokens=4) for rid in ids]  # fmt: skip
        assert [c.previous_response_id for c in chained] == ids and all(c.output for c in chained)
        assert [_read_on_every_replica(rid) for rid in ids] == [[rid, rid] for rid in ids]
        client.responses.delete(ids[0])
        assert _read_on_every_replica(ids[0]) == [404, 404]
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="sim", input="More?", previous_response_id=ids[0], max_output_tokens=4)
        store = ray.get_actor(store_name(APP), namespace=NAMESPACE)  # the app's one store
        assert ray.get(store.size.remote()) == STORED - 1  # the chained ones asked for no store
        serve.delete(APP)
        remove_response_store(APP)  # what `cbserve serve` does after deleting the app

        def store_gone() -> bool:
            try:
                ray.get_actor(store_name(APP), namespace=NAMESPACE)
            except ValueError:
                return True
            return False

        wait_for("the app's store gone", store_gone, 30, 0.2)
