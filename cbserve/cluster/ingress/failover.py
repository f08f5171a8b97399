"""One request's way to an engine replica and back, on the ingress side (``EngineClient.add`` makes one per
request): ``RoutedRequest.admit`` routes it (router.py), writes its ``AddRequest`` on the replica's channel and
waits for the answer; ``outputs`` then yields its outputs as they come. What the replica sends for the request
reaches the front end's ``RequestState`` (its queue, its replica, its routed cost: the ingress's one registry of
requests; engine_client.py hands each frame's items over).

When it runs elsewhere: a replica that turns it away (waiting queue full, or gone), or that is lost after admitting
it but before any of its outputs came back, is skipped for the next, unseen by the client. When no replica is
ready (all failed at once, or are being rebuilt) it waits up to ``FAILOVER_WAIT_S`` for one. The client sees a
429 when every ready replica is full and a 503 when none comes back in time. A replica lost after outputs were
streamed: the request goes on elsewhere as a continuation of what the client has (continuation.py), unless it is
one that cannot be continued (several sequences, output-counting penalties, structured output), which ends with
the error. A request whose own step failed ("failed", "rejected") is never retried,
and one that was on ``MAX_REPLICA_LOSSES`` replicas as they were lost is failed as the suspect it is (a request
that kills its worker would otherwise take one replica down after another).

In a P:D app (disaggregation.py) a request whose prompt is prefilled remotely runs on a prefill replica first
(``_remote_prefill``: its outputs are the prefill's, never the client's) and then, with the prefill's answer, on a
decode replica; failover applies to each leg among the replicas of its kind, and a prefill leg that fails leaves
the prompt to the decode replica.

``request_timeout_s``: a request still running that long after it came is aborted in its engine (its KV blocks are
freed) and ends with APIError 504 (type "timeout"). Leaving ``outputs`` early (client gone, stop string, timeout)
aborts the request in its engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from cbserve.cluster.channel.messages import AbortRequest, AddRequest, Admitted, EngineFailure
from cbserve.cluster.channel.reader import ChannelReader
from cbserve.cluster.ingress.continuation import continuation, why_not_continued
from cbserve.cluster.ingress.disaggregation import Disaggregation, decode_leg, prefill_leg
from cbserve.cluster.ingress.router import NoHealthyReplicaError, Router
from cbserve.frontend.output import RequestState
from cbserve.frontend.protocol import APIError
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

FAILOVER_WAIT_S = 30.0  # how long a request waits for a replica to be ready when none is
FAILOVER_POLL_S = 0.05
FULL_RETRY_S = 0.25  # how often a request failing over asks full replicas again for room
MAX_REPLICA_LOSSES = 2  # a request on this many replicas as they were lost is not retried again

_FAILURE_STATUS = {
    "rejected": 400, "duplicate": 400, "queue_full": 429, "unavailable": 503, "aborted": 503, "timeout": 504,
    "internal": 500, "failed": 500,
}  # fmt: skip
_FAILURE_TYPE = {
    "rejected": "invalid_request_error", "duplicate": "invalid_request_error", "queue_full": "rate_limit_exceeded",
    "unavailable": "service_unavailable", "aborted": "service_unavailable", "timeout": "timeout",
    "failed": "server_error",
}  # fmt: skip
# Failures that say nothing about the request itself (the replica was full, or is gone): another replica may take
# it, before admission or, if none of its outputs came back yet, after.
_TRY_ELSEWHERE = frozenset({"queue_full", "unavailable"})


def failure_to_api_error(failure: EngineFailure) -> APIError:
    status = _FAILURE_STATUS.get(failure.kind, 500)
    return APIError(status, failure.message, _FAILURE_TYPE.get(failure.kind, "internal_error"))


def routed_cost(request: EngineRequest) -> int:
    """The tokens a request brings to its replica: the one load formula (the router weighs replicas by it)."""
    sp = request.sampling_params
    return len(request.prompt_token_ids) + sp.num_sequences * (sp.max_tokens or 0)


class Replicas(Protocol):
    router: Router
    readers: list[ChannelReader]
    pd: Disaggregation | None  # a P:D app's policy (None: every replica serves whole requests)

    def recoverable(self) -> bool:
        """Whether some replica may still become ready (not all failed for good)."""
        ...


class RoutedRequest:
    def __init__(self, replicas: Replicas, state: RequestState, timeout_s: float | None) -> None:
        self.replicas, self.state, self.request = replicas, state, state.request
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout_s is None else loop.time() + timeout_s
        self.timeout_s = timeout_s
        self.failover_until = loop.time() + FAILOVER_WAIT_S
        self.full: set[int] = set()  # replicas whose waiting queue turned it away
        self.losses = 0  # replicas lost while they held it
        self.admitted_here = self.streamed = False
        self.others: frozenset[int] = frozenset()  # replicas of the other kind in a P:D app (never this leg's)
        self.original: EngineRequest | None = None  # once continued (continuation.py): the request it continues
        self.carry = 0.0  # a continuation's: the cumulative logprob of the tokens streamed before it
        lora = self.request.lora
        self.lora_id = None if lora is None else lora.lora_int_id
        self.extra_keys = self.request.extra_keys
        state.queue = asyncio.Queue()

    @classmethod
    async def start(cls, replicas: Replicas, state: RequestState, timeout_s: float | None
                    ) -> AsyncIterator[list[RequestOutput]]:
        """Route and send a request until a replica admits it (``admit``); then its outputs (``outputs``)."""
        routed = cls(replicas, state, timeout_s)
        await routed.admit()
        return routed.outputs()

    async def admit(self) -> None:
        """Route and send the request until a replica admits it (APIError when none will); in a P:D app, after its
        prefill leg when its prompt is prefilled remotely."""
        pd, kt = self.replicas.pd, self.request.kv_transfer
        if pd is not None and kt is not None and kt.remote_decode:
            self.others = pd.decode  # a proxy's prefill leg (vLLM's handshake): a prefill replica answers it
        elif pd is not None:
            if kt is None and pd.remote(self.request, self.extra_keys):
                await self._remote_prefill(pd)
            self.others = pd.prefill
        await self.admit_here()

    async def outputs(self) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs in batches, as its replica sends them; the consumer stops when the request is
        finished (the front end's ``RequestState`` counts its sequences). Closed early, the request is aborted."""
        queue = self.state.queue
        assert queue is not None
        try:
            while True:
                batch = [await self._next()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                outputs = [item for item in batch if isinstance(item, RequestOutput)]
                if outputs:
                    self._first_output()
                    if self.original is not None:
                        self._as_original(outputs)
                    yield outputs
                failure = next((item for item in batch if isinstance(item, EngineFailure)), None)
                if failure is not None:
                    self._retry_or_raise(failure)
                    await self.admit_here()
        finally:
            self._release(abort=not self.state.finished)

    async def _next(self) -> Any:
        """The next item of the request (within its deadline)."""
        queue = self.state.queue
        assert queue is not None
        if self.deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, self.deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            msg = f"the request did not finish within request_timeout_s ({self.timeout_s:g} s); it was aborted"
            raise failure_to_api_error(EngineFailure("timeout", msg)) from None

    async def _send(self) -> None:
        """Pick a replica and write the request on its channel (a channel that is down answers "unavailable")."""
        router, loop, cost = self.replicas.router, asyncio.get_running_loop(), routed_cost(self.request)
        while True:
            try:
                route = router.place(self.request.prompt_token_ids, cost, self.full | self.others, self.lora_id,
                                     self.extra_keys)
                break
            except NoHealthyReplicaError as e:
                if (self.full and not self._failing_over) or not self.replicas.recoverable() \
                        or loop.time() >= self.failover_until:
                    raise APIError(503, f"{e}; retry later", "service_unavailable") from e
            if self.full:  # failing over: the full replicas are asked again once their queues may have room
                self.full.clear()
                await asyncio.sleep(FULL_RETRY_S)
                continue
            await asyncio.sleep(FAILOVER_POLL_S)
        state = self.state
        state.replica, state.cost, state.prefill = route.replica, cost, route.prefill_tokens
        self.admitted_here = False
        if not self.replicas.readers[route.replica].send(AddRequest(self.request)):
            state.queue.put_nowait(EngineFailure("unavailable", f"engine replica {route.replica} is not connected"))

    async def _remote_prefill(self, pd: Disaggregation) -> None:
        """The prefill leg on a prefill replica, then the request itself carries its answer to a decode replica (none
        when the leg failed: the decode replica prefills the prompt)."""
        whole, self.request, self.others = self.request, prefill_leg(self.request), pd.decode
        answer, until = None, self.failover_until
        self.failover_until = asyncio.get_running_loop().time()  # no waiting for a prefill replica: decode does it
        try:
            await self.admit_here()
            while answer is None:
                item = await self._next()
                if isinstance(item, EngineFailure):
                    break
                if isinstance(item, RequestOutput) and item.finished:
                    answer = item.kv_transfer_params or {}
        except APIError as e:
            logger.warning("request %s: its prefill leg failed (%s); its decode replica prefills it",
                           whole.req_id, e.message)
        finally:
            self._release(abort=answer is None)
            self.request, self.full, self.losses, self.streamed = whole, set(), 0, False
            self.failover_until = until
        pd.count("remote" if answer else "local_failed")
        self.request = decode_leg(whole, answer or None)

    async def admit_here(self) -> None:
        """``admit`` among this leg's replicas (no P:D policy)."""
        while True:
            await self._send()
            item = await self._next()
            if isinstance(item, Admitted):
                self.admitted_here = True
                return
            if isinstance(item, EngineFailure):
                self._retry_or_raise(item)

    def _as_original(self, outputs: list[RequestOutput]) -> None:
        """A continuation's outputs as the original request's would say (its prompt, its cached tokens, its cumulative
        logprob)."""
        assert self.original is not None
        num_prompt = len(self.original.prompt_token_ids)
        for o in outputs:
            o.num_prompt_tokens, o.num_cached_tokens = num_prompt, min(o.num_cached_tokens, num_prompt)
            if o.cumulative_logprob is not None:
                o.cumulative_logprob += self.carry

    def _continued(self, failure: EngineFailure) -> bool:
        """Whether a request whose replica was lost after it streamed goes on elsewhere (as a continuation)."""
        why = "the replica failed it" if failure.kind != "unavailable" else why_not_continued(self.request)
        if why is not None:
            logger.warning("request %s: its replica failed after it streamed (%s); not continued: %s",
                           self.request.req_id, failure.message, why)
            return False
        tokens, logprob = self.state.streamed()  # what the client has (the front end's state of the request)
        self.original = self.original or self.request
        self.carry = logprob or 0.0
        self.request = continuation(self.original, tokens)
        self.failover_until = asyncio.get_running_loop().time() + FAILOVER_WAIT_S
        logger.warning("request %s: its replica was lost after %d tokens (%s); continuing it on another replica",
                       self.request.req_id, len(tokens), failure.message)
        return True

    def _retry_or_raise(self, failure: EngineFailure) -> None:
        """A failure from the request's replica: raise it to the client, or let the request run elsewhere."""
        idx = self.state.replica
        if failure.kind not in _TRY_ELSEWHERE or (self.streamed and not self._continued(failure)):
            raise failure_to_api_error(failure)
        self.losses += self.admitted_here and failure.kind == "unavailable"
        self._release(abort=False)
        if self.losses >= MAX_REPLICA_LOSSES:
            logger.error("request %s was on %d engine replicas as they were lost: failed as a suspect, not retried",
                         self.request.req_id, self.losses)
            raise APIError(500, f"the request was running on {self.losses} engine replicas that were lost; it is "
                           "not retried again", "server_error")
        if failure.kind == "unavailable" and idx is not None:
            self.replicas.router.set_healthy(idx, False)  # until its channel says it is ready again
        if failure.kind == "queue_full":
            self.full.add(idx)  # type: ignore[arg-type]
            if not self._failing_over and \
                    not any(i not in self.full | self.others for i in self.replicas.router.healthy_replicas()):
                raise failure_to_api_error(failure)  # a new request the app has no room for: 429
        elif asyncio.get_running_loop().time() >= self.failover_until:  # replicas keep failing it
            raise failure_to_api_error(failure)
        elif self.admitted_here and not self.streamed:
            logger.warning("engine replica %s failed before request %s's first output (%s); running it on another "
                           "replica", idx, self.request.req_id, failure.message)

    @property
    def _failing_over(self) -> bool:
        """Whether full queues make it wait for room (within the failover window) rather than fail: a replica lost it
        after admitting it (or streaming), so the app took it; or a replica is down, so the app is short of the room
        it has when whole (the requests of the lost replica fill the others for a while)."""
        router = self.replicas.router
        return self.losses > 0 or self.original is not None or len(router.healthy_replicas()) < len(router.replicas)

    def _first_output(self) -> None:
        """Outputs reached the caller: its prefill no longer queues at its replica, and a retry would repeat them."""
        if self.state.prefill and self.state.replica is not None:
            self.replicas.router.prefilled(self.state.replica, self.state.prefill)
            self.state.prefill = 0
        self.streamed = True

    def _release(self, abort: bool) -> None:
        """The request leaves its replica: the router's load and queue forget it; ``abort``: it is ended there."""
        state, idx = self.state, self.state.replica
        if idx is None:
            return
        router = self.replicas.router
        router.prefilled(idx, state.prefill)
        router.done(idx, state.cost)
        state.replica, state.prefill = None, 0
        if abort:
            self.replicas.readers[idx].send(AbortRequest(self.request.req_id))
        queue = state.queue
        while queue is not None and not queue.empty():  # what the old replica sent is stale now
            queue.get_nowait()
