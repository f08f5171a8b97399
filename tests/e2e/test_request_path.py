"""The request path of docs/design.md ("One request, end to end") is the path a real request takes: one streamed
chat completion to the bundled model on a real local Ray, each process recording the files its code runs through
(cbserve/cluster/ops/path_trace.py: the ingress replica, and the engine replica's SchedulerActor, whose event loop
and in-actor rank's model thread both record), and each of the document's legs must be found, file for file, in
that process's record. The figures the document states (hops per leg and in all, distinct files, files entered
more than once) must be the ones its legs give (a hop: a move into another file where code on the path runs)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import local_serve_app

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "num_replicas": 1, "worker_num_cpus": 1,
        "worker_torch_threads": 1, "kv_cache_memory_bytes": 32 * 1024**2, "node_tuning": "off",
        "routing": "round_robin"}
_LEG = re.compile(r"^Leg `(ingress|engine)`[^:]*?, (\d+) hops?: (.+)$", re.M)


def _section() -> str:
    return DESIGN.read_text().split("\n## One request, end to end\n", 1)[1].split("\n## ", 1)[0]


def documented_legs() -> list[tuple[str, list[str], int]]:
    """(process, files, hops stated) of every leg the document lists: a line
    ``Leg `process` (what), N hops: `a.py` -> `b.py` -> ...``."""
    return [(proc, re.findall(r"`([^`]+\.py)`", files), int(n)) for proc, n, files in _LEG.findall(_section())]


def test_the_documented_figures_are_the_legs_figures() -> None:
    legs = documented_legs()
    assert all(len(files) == hops for _, files, hops in legs), [(len(f), h) for _, f, h in legs]
    entered = Counter(f for _, files, _ in legs for f in files)
    total = " + ".join(str(h) for _, _, h in legs)
    summary = " ".join(_section().split())
    assert f"the way in is {sum(h for _, _, h in legs)} hops in the five legs below ({total})" in summary
    assert len(legs) == 5
    assert f"through {len(entered)} distinct files; {sum(n > 1 for n in entered.values())} of those" in summary


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with local_serve_app(ARGS, "path") as base:
        yield base


def _actors() -> tuple[Any, Any]:
    from ray import serve

    from cbserve.cluster.ops.names import NAMESPACE, engine_actor_names

    ingress = serve.get_deployment_handle("OpenAIIngress", "path")
    engine = ray.get_actor(engine_actor_names("path")[0], namespace=NAMESPACE)
    assert ray.get(engine.worker_handles.remote()) == []  # tensor-parallel size 1: the rank runs in the actor
    return ingress, engine


def _traced(url: str) -> dict[str, list[list[str]]]:
    """The legs each process recorded while one streamed chat completion ran."""
    ingress, engine = _actors()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2, temperature=0,
                                   messages=[{"role": "user", "content": "Hi"}])  # warm: imports, caches
    ingress.path_trace.remote("start").result()
    ray.get(engine.path_trace.remote("start"))
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert len([c for c in stream]) >= 2
    return {"engine": list(ray.get(engine.path_trace.remote("stop")).values()),
            "ingress": list(ingress.path_trace.remote("stop").result().values())}


def _contains(leg: list[str], want: list[str]) -> bool:
    return any(leg[i : i + len(want)] == want for i in range(len(leg) - len(want) + 1))


def test_every_documented_leg_is_the_path_a_request_takes(url: str) -> None:
    legs = documented_legs()
    assert {proc for proc, _, _ in legs} == {"ingress", "engine"}
    traced = _traced(url)
    for proc, want, _ in legs:
        assert any(_contains(leg, want) for leg in traced[proc]), (
            f"the {proc} leg {' -> '.join(want)} was not taken; recorded: "
            + "; ".join(" -> ".join(leg) for leg in traced[proc]))
