"""The engine client after a replica streamed (cluster/ingress/continuation.py) and in a P:D app
(cluster/ingress/disaggregation.py), over the channel fakes of client_fakes.py: a stream whose replica is lost goes on
from another as a continuation of its tokens unless it cannot be continued; a prefill leg's answer goes with the
request to its decode replica, and a prefill leg that fails, in any way, leaves the prompt to the decode replica at
once."""

from __future__ import annotations

import time
from typing import Any

import pytest
from client_fakes import DROP, FULL, FakeEngine, State, client_over, load_on, out, run_one

import cbserve.cluster.ingress.failover as failover
from cbserve.cluster.channel.messages import EngineFailure
from cbserve.cluster.ingress.engine_client import EngineClient
from cbserve.frontend.protocol import APIError
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams


def test_a_replica_lost_after_outputs_continues_the_stream_on_another() -> None:
    lost = EngineFailure("unavailable", "lost")
    dying, other = FakeEngine([[], [out(1)], [out(5)], lost]), FakeEngine([[], [out(2)], [out(3, True)]])
    client = client_over(dying, other)
    got = run_one(client, load_on(client))
    assert [o.new_token_ids for o in got] == [[1], [5], [2], [3]]  # the client's stream goes on, nothing repeated
    go_on = other.requests[0]
    assert go_on.prompt_token_ids == [1, 2, 3, 1, 5] and go_on.sampling_params.max_tokens == 2
    assert all(o.num_prompt_tokens == 3 for o in got[2:])  # as the original request's outputs say


@pytest.mark.parametrize("params", [dict(presence_penalty=0.5), dict(n=2), dict(frequency_penalty=-1.0)])
def test_a_request_that_cannot_be_continued_ends_with_the_error(params: dict[str, Any]) -> None:
    dying, other = FakeEngine([[], [out(1)], EngineFailure("unavailable", "lost")]), FakeEngine([[], [out(2, True)]])
    client = client_over(dying, other)
    state = State()
    state.request = EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, **params))
    with pytest.raises(APIError) as info:
        run_one(client, load_on(client), state=state)
    assert info.value.status == 503
    assert other.calls == 0  # its outputs were streamed and a continuation would change what it samples




# ---- a P:D app (cluster/ingress/disaggregation.py): replica 0 prefills, replica 1 decodes ----------------------------
ANSWER = {"do_remote_prefill": True, "remote_engine_id": "key-1-abc", "remote_block_ids": [0]}


def _pd(prefill: FakeEngine, decode: FakeEngine) -> EngineClient:
    from cbserve.cluster.ingress.disaggregation import Disaggregation
    from cbserve.config.pd_config import PDConfig

    client = client_over(prefill, decode)
    client.pd = Disaggregation(PDConfig(prefill_replicas=1, decode_replicas=1, min_remote_prefill_tokens=0),
                               client.router)  # fmt: skip
    return client


def test_pd_the_prefill_legs_answer_goes_with_the_request_to_the_decode_replica() -> None:
    first = RequestOutput("r1", 0, [5], None, finished=True, finish_reason="length", kv_transfer_params=ANSWER)
    prefill, decode = FakeEngine(["ok", first]), FakeEngine(["ok", out(7, finished=True)])
    client = _pd(prefill, decode)
    got = run_one(client)
    assert [o.new_token_ids for o in got] == [[7]]  # the prefill leg's token is never the client's
    p, d = prefill.requests[0], decode.requests[0]
    assert p.sampling_params.max_tokens == 1 and p.kv_transfer is not None and p.kv_transfer.remote_decode
    assert d.kv_transfer is not None and (d.kv_transfer.remote_engine, d.kv_transfer.remote_blocks) == ("key-1-abc", 1)
    assert d.sampling_params.max_tokens == 4 and not prefill.aborted and not decode.aborted
    assert client.router.take_stats().disaggregation == {"remote": 1}


@pytest.mark.parametrize("prefill_items", [[DROP], [FULL], ["ok", EngineFailure("failed", "its step failed")]])
def test_pd_a_prefill_leg_that_fails_leaves_the_prompt_to_the_decode_replica(prefill_items: list[Any]) -> None:
    prefill, decode = FakeEngine(prefill_items), FakeEngine(["ok", out(7, finished=True)])
    client = _pd(prefill, decode)
    t0 = time.monotonic()
    got = run_one(client)
    assert [o.new_token_ids for o in got] == [[7]] and decode.requests[0].kv_transfer is None
    assert time.monotonic() - t0 < failover.FAILOVER_WAIT_S / 2  # no waiting for a prefill replica to come back
    assert client.router.take_stats().disaggregation == {"local_failed": 1}
