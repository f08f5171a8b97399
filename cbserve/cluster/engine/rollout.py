"""An engine replica's controls for an RL loop: what vLLM's ``pause_generation`` / ``sleep`` / ``wake_up`` /
``reset_prefix_cache`` / weight-transfer calls and Ray's ``LLMServer`` do, on cbserve's engine (``Rollout``: one per
built engine, held by the SchedulerActor, which exposes each control as a Ray call; rl/engines.py calls them on every
replica of an app, the ingress's /pause, /sleep... routes too).

- **pause / resume**: "keep" holds every request (its KV kept: it goes on where it stopped), "abort" ends them
  (finish reason "abort"), "wait" lets the started ones finish and returns then; requests that arrive while paused
  wait (scheduler/policies.py ``paused_may_run``).
- **sleep / wake_up**: the ranks free their KV cache (level 1) and their weights (level 2; woken from the model's
  files) (worker/loading/sleep_mode.py); the running requests are preempted first and recomputed after the wake, so
  none is lost; nothing is scheduled while anything sleeps.
- **update_weights**: every rank takes the new weights in (from the object store, or from the trainer's weight
  group: rl/weight_sync.py) while the steps go on; then the engine holds, lets the steps in flight land, and one
  ``RankCall`` applies them on every rank between two steps (worker/loading/weight_update.py): no step runs on half
  of them. The prefix cache then serves no block computed before (``EngineCore.set_weights_version``), and every
  output carries the new version.

A control that holds the engine ("hold") sets the scheduler's pause to "keep" and waits for the steps in flight; it
then restores what the user asked (``user_pause``) unless something sleeps. A rebuilt engine (after a lost worker)
starts awake, unpaused, with the weights of the model's files (version 0).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from cbserve.scheduler.engine_core import EngineCore

HOLD_POLL_S = 0.002  # how often a control looks whether the steps in flight have landed
SLEEP_TAGS = {1: ("kv_cache",), 2: ("kv_cache", "weights")}


class Rollout:
    def __init__(self, engine: EngineCore, executor: Any, wake: Callable[[], None]) -> None:
        self.engine = engine
        self.executor = executor  # the RayExecutor: ``call_ranks``, ``stage_weights``, ``receive_weights``...
        self.wake = wake  # the engine loop's: it looks at the engine again
        self.user_pause: str | None = None  # "keep" or "wait": what pause() asked, until resume()
        self.asleep: set[str] = set()  # what sleeps: "kv_cache", "weights"
        self.lock = asyncio.Lock()  # one control that holds the engine at a time

    # ---- pause ------------------------------------------------------------------------------------
    async def pause(self, mode: str = "keep") -> dict[str, Any]:
        """Pause; returns once nothing runs ("keep", "abort") or the started requests finished ("wait")."""
        engine = self.engine
        aborted = len(engine.groups) if mode == "abort" else 0
        engine.pause(mode)  # ValueError for a mode it does not know
        self.user_pause = engine.scheduler.pause_mode
        self.wake()
        await self._land(mode == "wait")
        return {"paused": True, "mode": mode, "aborted": aborted, "waiting": len(engine.groups)}

    async def resume(self) -> dict[str, Any]:
        self.user_pause = None
        if not self.asleep:
            self.engine.resume()
        self.wake()
        return {"paused": self.is_paused()}

    def is_paused(self) -> bool:
        return self.user_pause is not None or bool(self.asleep)

    async def _land(self, finished: bool = False) -> None:
        """Until the steps in flight landed (``finished``: and the started requests finished)."""
        while self.engine.batch_queue or (finished and not self.engine.drained()):
            await asyncio.sleep(HOLD_POLL_S)

    async def _hold(self) -> None:
        self.engine.scheduler.pause_mode = "keep"
        await self._land()

    def _release(self) -> None:
        self.engine.scheduler.pause_mode = "keep" if self.asleep else self.user_pause
        self.wake()

    # ---- sleep ------------------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> dict[str, Any]:
        if level not in SLEEP_TAGS:
            raise ValueError(f"sleep level {level!r}: expected 1 (the KV cache) or 2 (the KV cache and the weights)")
        async with self.lock:
            await self._hold()
            try:
                if "kv_cache" not in self.asleep:
                    self.engine.drop_kv()  # the running requests are recomputed after the wake
                report = await self.executor.call_ranks("sleep", level)
                self.asleep.update(SLEEP_TAGS[level])
            finally:
                self._release()
        return {**report, "sleeping": sorted(self.asleep)}

    async def wake_up(self, tags: Iterable[str] | None = None) -> dict[str, Any]:
        wanted = list(tags) if tags is not None else ["weights", "kv_cache"]
        unknown = sorted(set(wanted) - {"weights", "kv_cache"})
        if unknown:
            raise ValueError(f"wake_up tags {unknown}: expected 'weights' and/or 'kv_cache'")
        async with self.lock:
            await self._hold()
            try:
                order = [t for t in ("weights", "kv_cache") if t in wanted]  # the weights first: graphs need them
                report = await self.executor.call_ranks("wake_up", order)
                self.asleep.difference_update(order)
            finally:
                self._release()
        return {**report, "sleeping": sorted(self.asleep)}

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    # ---- prefix cache and weights -----------------------------------------------------------------
    def reset_prefix_cache(self) -> dict[str, Any]:
        """No cached block is served again (blocks in use stay with their requests)."""
        return {"forgotten_blocks": self.engine.scheduler.kv.reset_prefix_cache()}

    async def update_weights(self, ref: Any = None, version: int | None = None) -> dict[str, Any]:
        """New weights on every rank: from the object store (``ref``), else from the trainer's weight group (it
        broadcasts them now: ``init_weight_transfer`` first). ``version``: what outputs say from now on (default:
        the current one + 1). The update is applied between two steps; a refused one changes nothing."""
        if "weights" in self.asleep:
            raise RuntimeError("the weights sleep (level 2): wake_up(['weights']) before update_weights")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        loop = asyncio.get_running_loop()
        start = loop.time()
        if ref is not None:
            await self.executor.stage_weights(ref)
        else:
            await self.executor.receive_weights()
        staged = loop.time()
        async with self.lock:
            await self._hold()
            try:
                report = await self.executor.call_ranks("apply_weights")
                new = self.engine.weights_version + 1 if version is None else version
                self.engine.set_weights_version(new)
            finally:
                self._release()
        end = loop.time()
        return {**report, "version": new, "transfer_s": staged - start, "apply_s": end - staged, "sync_s": end - start}
