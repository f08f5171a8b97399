"""Prefill/decode disaggregation on the ingress side (``--pd P:D``, config/pd_config.py): which requests are prefilled
on a prefill replica, and the request each leg sends.

Replicas 0..P-1 are prefill replicas (``kv_producer``), P..P+D-1 decode replicas (``kv_consumer``). A request goes to
a prefill replica first when its prompt has at least ``min_remote_prefill_tokens`` tokens that the decode replicas'
prefix caches do not hold (as the router's index sees them) and the prefill replicas are not swamped (the least
queued one has at most ``max_prefill_queue_tokens`` prompt tokens to prefill ahead of it): Dynamo's conditional
disaggregation. The prefill leg (failover.py's ``RoutedRequest``) is the prompt with one greedy token and
``do_remote_decode``; its answer names the producer and its blocks, and the decode leg, the request itself with that
answer, goes to a decode replica, which pulls the blocks (scheduler/kv/offload.py) and streams the tokens. Any
failure of the prefill leg (its replica full, lost, or failing it) leaves the prompt to the decode replica: a request
is never lost to disaggregation. A request that carries vLLM's handshake itself (a proxy drives the app) goes where
it says: ``do_remote_decode`` to a prefill replica, ``do_remote_prefill`` to a decode replica. Every choice is
counted (the router's ``RoutingStats.disaggregation``, exported as ``cbserve_pd_prefills``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cbserve.cluster.ingress.router import Router
from cbserve.config.pd_config import PDConfig
from cbserve.scheduler.requests.kv_transfer import KVTransferParams
from cbserve.scheduler.requests.request import EngineRequest
from cbserve.scheduler.requests.sampling_params import SamplingParams


class Disaggregation:
    def __init__(self, config: PDConfig, router: Router) -> None:
        self.config, self.router = config, router
        self.prefill = frozenset(range(config.prefill_replicas))
        self.decode = frozenset(range(config.prefill_replicas, config.prefill_replicas + config.decode_replicas))

    def count(self, decision: str) -> None:
        """One request's decision, in the router's stats (exported with its own)."""
        decisions = self.router.stats.disaggregation
        decisions[decision] = decisions.get(decision, 0) + 1

    def remote(self, request: EngineRequest, extra_keys: tuple) -> bool:
        """Whether ``request`` is prefilled on a prefill replica (counted when it is not)."""
        sp = request.sampling_params
        if request.lora is not None or sp.prompt_logprobs is not None:
            self.count("local_unfit")  # an adapter's blocks are not published; prompt logprobs need the prompt here
            return False
        r, bs = self.router, self.router.block_size
        decode = [i for i in r.healthy_replicas() if i in self.decode]
        found = r.index.matched(request.prompt_token_ids, extra_keys, decode) if decode else {}
        cached = max((pool + tier for pool, tier in found.values()), default=0) * bs  # pool and tier hits
        if len(request.prompt_token_ids) - cached < self.config.min_remote_prefill_tokens:
            self.count("local_short")
            return False
        queued = [r.replicas[i].pending_prefill_tokens for i in r.healthy_replicas() if i in self.prefill]
        if not queued or min(queued) > self.config.max_prefill_queue_tokens:
            self.count("local_busy")
            return False
        return True


def prefill_leg(request: EngineRequest) -> EngineRequest:
    """The request a prefill replica runs: the prompt (its cache keys kept) with one greedy token, publishing its KV."""
    return replace(request, sampling_params=SamplingParams(temperature=0.0, max_tokens=1), retention=(),
                   kv_transfer=KVTransferParams(remote_decode=True))


def decode_leg(request: EngineRequest, answer: dict[str, Any] | None) -> EngineRequest:
    """The request a decode replica runs: pulling the blocks the prefill leg's ``answer`` names (None: none)."""
    kt = None if answer is None else KVTransferParams.from_json(answer)
    return request if kt is None else replace(request, kv_transfer=kt)
