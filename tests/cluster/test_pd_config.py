"""A P:D app's per-side configuration (config/pd_config.py): each engine replica's role, torch threads and
transport, and what a standalone ``kv_role`` server refuses."""

from __future__ import annotations

import pytest

from cbserve.config import CBServeConfig


def test_a_pd_app_gives_each_side_its_role_threads_and_transport() -> None:
    from cbserve.config.pd_config import config_for_replica

    pd = {"prefill_replicas": 1, "decode_replicas": 2, "prefill_torch_threads": 2, "transport": "ray"}
    app = CBServeConfig(device="cpu", worker_torch_threads=1, disaggregation=pd)
    sides = [config_for_replica(app, i) for i in range(3)]
    assert [(s.disaggregation.kv_role, s.worker_torch_threads) for s in sides] == [
        ("kv_producer", 2), ("kv_consumer", 1), ("kv_consumer", 1)]  # fmt: skip
    assert {s.worker_model_config().kv_transport for s in sides} == {"ray"}
    with pytest.raises(ValueError, match="size the sides of a P:D app"):
        CBServeConfig(device="cpu", disaggregation={"kv_role": "kv_producer", "decode_torch_threads": 2})
    with pytest.raises(ValueError, match="transport"):
        CBServeConfig(device="cpu", disaggregation={"kv_role": "kv_consumer", "transport": "nccl"})
