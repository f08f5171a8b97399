"""One local Ray instance and one Serve instance for the end-to-end modules that need nothing special of them
(``shared_ray``): each deploys its apps there and removes them as it ends (``SharedRay.apps``), instead of starting
and stopping a Ray instance of its own (about 10 s a module on 2 cores). 16 CPUs (logical: the most any module's apps
ask for), a namespace of its own (not the engines' ``cbserve``), a 512 MiB object store, actors at niceness 0
(``e2e_lib.RAY_ENV``). Before a module deploys its apps, those of the module before are gone, with their engines and
their stores (``SharedRay.settle``).

Modules that need a Ray instance of their own start it themselves (test_prometheus.py: the dashboard and a fast
metrics export; test_multinode.py: a cluster of simulated nodes; test_request_path.py: ``e2e_lib.local_serve_app``;
``cbserve serve`` and ``cbserve bench`` subprocesses). The modules that share the instance run first, one after the
other, and the shared instance stops before any test that does not ask for it, so no two Ray instances ever run in
this process (nor side by side)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_lib import SharedRay

SHARED = "shared_ray"
_CLUSTER = pytest.StashKey[SharedRay]()


@pytest.fixture(scope="session")
def shared_ray(request: pytest.FixtureRequest) -> Iterator[SharedRay]:
    """The shared instance: started by the first module's apps, restarted by a later module if it was stopped."""
    cluster = SharedRay(num_cpus=16, namespace="cbserve-e2e", object_store_mb=512)
    request.session.stash[_CLUSTER] = cluster
    try:
        yield cluster
    finally:
        cluster.stop()


def _shares(item: pytest.Item) -> bool:
    return SHARED in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use the shared instance side by side, in their order, where the first of them was; the others
    keep their order, after them."""
    sharing = [item for item in items if _shares(item)]
    if not sharing:
        return
    first = items.index(sharing[0])
    rest = [item for item in items[first:] if not _shares(item)]
    items[first:] = sharing + rest


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of a run of those that share the instance (and their module's apps went), the instance
    stops: the next test starts Ray itself, or a subprocess that does."""
    cluster = item.session.stash.get(_CLUSTER, None)
    if cluster is not None and _shares(item) and (nextitem is None or not _shares(nextitem)):
        cluster.stop()
