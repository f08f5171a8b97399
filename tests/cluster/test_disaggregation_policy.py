"""A P:D app's policy on the ingress side (cluster/ingress/disaggregation.py), on the real Router: which prompts go to
a prefill replica first (Dynamo's conditional rule: enough uncached tokens on the decode replicas, the prefill
replicas not swamped), what each leg sends, and every decision counted in the router's stats."""

from __future__ import annotations

from cbserve.cluster.ingress.disaggregation import Disaggregation, decode_leg, prefill_leg
from cbserve.cluster.ingress.router import Router
from cbserve.config.pd_config import PDConfig
from cbserve.scheduler.kv.kv_events import KVCacheEvents, prompt_block_hashes
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import EngineRequest
from cbserve.scheduler.requests.retention import Retention
from cbserve.scheduler.requests.sampling_params import SamplingParams

BS = 4


def _policy(**keys: int) -> tuple[Disaggregation, Router]:
    router = Router(3, BS)
    for i in range(3):
        router.set_healthy(i, True)
    pd = Disaggregation(PDConfig(prefill_replicas=1, decode_replicas=2, **keys), router)
    return pd, router


def _request(n: int, **extra: object) -> EngineRequest:
    return EngineRequest("r", list(range(1, n + 1)), SamplingParams(max_tokens=9, temperature=0.7), **extra)


def test_long_uncached_prompts_go_remote_short_cached_or_unfit_ones_stay() -> None:
    pd, router = _policy(min_remote_prefill_tokens=32, max_prefill_queue_tokens=100)
    assert pd.remote(_request(40), ()) and not pd.remote(_request(20), ())
    lora = LoRARequest("a", 1, "/a")
    assert not pd.remote(_request(40, lora=lora), ())
    router.apply_cache_events(1, KVCacheEvents(stored=list(prompt_block_hashes(list(range(1, 41)), BS, ()))))
    assert not pd.remote(_request(40), ())  # a decode replica holds it all: nothing worth moving
    router.add(0, 200, prefill_tokens=200)  # the prefill replica has 200 tokens to prefill ahead
    assert not pd.remote(_request(80), ())
    router.set_healthy(0, False)
    router.prefilled(0, 200)
    assert not pd.remote(_request(80), ())  # no prefill replica ready
    # ("remote" is counted by the prefill leg once it answered: failover.py)
    assert router.take_stats().disaggregation == {"local_short": 2, "local_unfit": 1, "local_busy": 2}


def test_the_legs_keep_the_prompt_and_its_keys_and_carry_the_answer() -> None:
    whole = _request(40, cache_salt="s", priority=3, retention=(Retention(0, 40, 5, 60.0),))
    p = prefill_leg(whole)
    assert (p.prompt_token_ids, p.cache_salt, p.priority, p.req_id) == (whole.prompt_token_ids, "s", 3, "r")
    assert p.sampling_params.max_tokens == 1 and p.sampling_params.temperature == 0 and p.retention == ()
    assert p.kv_transfer is not None and p.kv_transfer.remote_decode
    answer = {"do_remote_prefill": True, "remote_engine_id": "k-1-a", "remote_block_ids": [0, 1, 2]}
    d = decode_leg(whole, answer)
    assert d.sampling_params is whole.sampling_params and d.retention == whole.retention
    assert d.kv_transfer is not None and (d.kv_transfer.remote_engine, d.kv_transfer.remote_blocks) == ("k-1-a", 3)
    assert decode_leg(whole, None) is whole
