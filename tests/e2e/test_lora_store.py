"""The app's LoRA store on a real local Ray (``cluster/stores/lora_store.py``): it keeps the bytes each adapter was
checked
with, by digest, and a worker's ``StoreAdapterSource`` fetches them (from its app's store, or, named by their
digest, from another app's); an unloaded adapter's bytes stay for the requests still running with it, up to the
bound; bytes no store keeps are a ``LoRAAdapterError``. The store's namespace is the engines'."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_lib import SharedRay

from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.worker.lora.files import AdapterContent, LoRAAdapterError

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def local_ray(shared_ray: SharedRay) -> None:
    """The shared Ray instance (its namespace is not the engines')."""
    shared_ray.start()


def _content(i: int) -> AdapterContent:
    return AdapterContent.of(b'{"peft_type": "LORA"}', bytes([i]) * 1000)


def test_workers_fetch_the_checked_bytes_by_digest(local_ray: None, tmp_path: Path) -> None:
    from cbserve.cluster.ops.names import NAMESPACE
    from cbserve.cluster.stores.lora_store import LoRAStore, StoreAdapterSource, remove_store, store_name
    from cbserve.frontend.lora_registry import CheckedAdapter

    store = LoRAStore.options(name=store_name("app"), namespace=NAMESPACE).remote()
    one, two = _content(1), _content(2)
    seeded = ray.get(store.seed.remote("base", "model", {"one": CheckedAdapter(str(tmp_path / "one"), one)}))
    answer = ray.get(store.register.remote("two", str(tmp_path / "two"), False, two))
    assert [a.digest for a in answer.adapters] == [one.digest, two.digest] and seeded.adapters[0].digest == one.digest
    source, elsewhere = StoreAdapterSource("app"), StoreAdapterSource("another-app")  # the latter: no store of its own
    assert source(answer.adapters[1]) == elsewhere(answer.adapters[1]) == (two.config, two.weights)
    ray.get(store.unregister.remote("two", None))
    assert source(answer.adapters[1]) == (two.config, two.weights)  # unloaded: kept for the requests running
    with pytest.raises(LoRAAdapterError, match="no longer kept"):
        source(LoRARequest("x", 9, "/x", _content(3).digest))
    with pytest.raises(LoRAAdapterError, match="names no checked content"):
        source(LoRARequest("x", 9, "/x"))
    remove_store("app")
