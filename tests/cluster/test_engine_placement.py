"""Where an engine replica's actor runs (``engine_client.engine_placement``), and the build count the ingress shows
for a replica across the restarts of its actor (``EngineState.actor``)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from cbserve.cluster.channel.messages import EngineState
from cbserve.cluster.ingress import engine_client
from cbserve.cluster.ingress.engine_client import EngineClient, engine_placement
from cbserve.config import CBServeConfig

NODE = "ab" * 28


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> None:
    context = argparse.Namespace(get_node_id=lambda: NODE)
    monkeypatch.setattr(engine_client.ray, "get_runtime_context", lambda: context)


def test_one_rank_runs_in_the_engine_actor_on_the_ranks_resources(here: None) -> None:
    cpu = engine_placement(CBServeConfig(device="cpu", worker_num_cpus=3))
    assert (cpu["num_cpus"], cpu["num_gpus"]) == (3, 0)
    strategy = cpu["scheduling_strategy"]
    assert (strategy.node_id, strategy.soft) == (NODE, True)  # beside the ingress when its node has room
    gpu = engine_placement(CBServeConfig(device="cuda", worker_num_cpus=2))
    assert (gpu["num_cpus"], gpu["num_gpus"]) == (2, 1)


def test_a_tensor_parallel_scheduler_takes_no_cpu_beside_its_ingress(here: None) -> None:
    tp = engine_placement(CBServeConfig(device="cpu", tensor_parallel_size=2, worker_num_cpus=3))
    assert tp["num_cpus"] == 0 and "num_gpus" not in tp
    assert (tp["scheduling_strategy"].node_id, tp["scheduling_strategy"].soft) == (NODE, False)


def test_the_build_count_goes_on_across_restarts_of_the_actor(here: None, monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeActorClass:
        def options(self, **kw: Any) -> Any:
            return argparse.Namespace(remote=lambda *args: object())

    monkeypatch.setattr(engine_client, "SchedulerActor", FakeActorClass())
    client = EngineClient(CBServeConfig(device="cpu", num_replicas=2), "app", "owner", {})

    def seen(replica: int, state: EngineState) -> tuple[str, int]:
        client._set_state(replica, state)
        return client.health[replica]["state"], client.health[replica]["generation"]

    assert seen(0, EngineState("starting", 0, actor="a")) == ("starting", 0)
    assert seen(0, EngineState("ready", 1, actor="a")) == ("ready", 1)
    assert seen(0, EngineState("restarting", 1, "a step kept failing", "a")) == ("restarting", 1)
    assert seen(0, EngineState("ready", 2, actor="a")) == ("ready", 2)
    assert seen(0, EngineState("unreachable", error="its channel closed")) == ("unreachable", 2)  # set here
    assert seen(0, EngineState("starting", 0, actor="b")) == ("starting", 2)  # Ray restarted it
    assert seen(0, EngineState("ready", 1, actor="b")) == ("ready", 3)
    assert seen(0, EngineState("ready", 1, actor="b")) == ("ready", 3)  # a channel reopened to the same actor
    assert seen(1, EngineState("ready", 1, actor="c")) == ("ready", 1)  # replicas count apart
