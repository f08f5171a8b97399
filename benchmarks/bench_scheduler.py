"""Scheduler-only step time: N running decode requests, a fake executor, no model.

Prints microseconds per step (mean, p50, p99) for EngineCore.schedule() and update_from_output().
Goal: < 1 ms per step in total with 256 running decode requests. ``--async-scheduling`` measures the
served engine's mode: each step is scheduled before the previous step's output is applied.

    python benchmarks/bench_scheduler.py --num-requests 256 --steps 1000
    python benchmarks/bench_scheduler.py --num-requests 256 --steps 1000 --async-scheduling
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import Future

from cbserve.scheduler import (
    CacheConfig,
    EngineConfig,
    EngineCore,
    EngineRequest,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    tune_gc_for_serving,
)
from cbserve.scheduler.outputs import done_future


class FakeExecutor:
    """Samples one token for every request whose known tokens are all computed, and keeps it (as the worker
    does: the scheduler does not send samples back). No model."""

    def __init__(self) -> None:
        self.state: dict[str, list[int]] = {}  # req id -> [num known tokens, num computed]

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        return done_future(self.run(so))

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        state = self.state
        for rid in so.finished_req_ids | so.preempted_req_ids:
            state.pop(rid, None)
        for new in so.scheduled_new_reqs:
            state[new.req_id] = [len(new.token_ids), new.num_computed_tokens]
        for cached in so.scheduled_cached_reqs:
            state[cached.req_id][0] += len(cached.new_token_ids)
        out = ModelRunnerOutput()
        for rid, num in so.num_scheduled_tokens.items():
            st = state[rid]
            st[1] += num
            if st[1] == st[0]:
                out.req_ids.append(rid)
                out.sampled_token_ids.append([(st[0] * 7919) % 32000])
                out.logprobs.append(None)
                st[0] += 1
        return out

    def shutdown(self) -> None:
        pass


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(name: str, seconds: list[float]) -> dict[str, float]:
    us = [s * 1e6 for s in seconds]
    row = {"mean_us": statistics.fmean(us), "p50_us": percentile(us, 0.5), "p99_us": percentile(us, 0.99)}
    print(f"{name:<20} mean {row['mean_us']:8.1f} us   p50 {row['p50_us']:8.1f} us   p99 {row['p99_us']:8.1f} us")
    return row


def time_steps(
    engine: EngineCore, executor: FakeExecutor, steps: int, overlap: bool, num_requests: int
) -> tuple[list[float], list[float], list[float]] | None:
    """Seconds in schedule(), update_from_output() and both, per step (None: a request went unscheduled)."""
    sched_t: list[float] = []
    update_t: list[float] = []
    total_t: list[float] = []
    previous = None  # async scheduling: the step whose output is applied after the next one is scheduled
    for _ in range(steps):
        t0 = time.perf_counter()
        so = engine.schedule()
        t1 = time.perf_counter()
        out = executor.run(so)
        t2 = time.perf_counter()
        if overlap:
            if previous is not None:
                engine.update_from_output(*previous)
            previous = (so, out)
        else:
            engine.update_from_output(so, out)
        t3 = time.perf_counter()
        if len(so.num_scheduled_tokens) != num_requests:
            return None
        sched_t.append(t1 - t0)
        update_t.append(t3 - t2)
        total_t.append((t1 - t0) + (t3 - t2))
    return sched_t, update_t, total_t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    p.add_argument("--default-gc", action="store_true", help="keep CPython's GC thresholds (engines tune them)")
    p.add_argument("--async-scheduling", action="store_true", help="schedule each step before the previous update")
    args = p.parse_args(argv)

    max_len = args.prompt_len + args.steps + 16
    blocks_per_req = -(-max_len // args.block_size)
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(8192, args.num_requests), max_num_seqs=args.num_requests,
            max_model_len=max_len, async_scheduling=args.async_scheduling,
        ),
        cache=CacheConfig(
            block_size=args.block_size, num_blocks=blocks_per_req * args.num_requests + 1,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
    )  # fmt: skip
    executor = FakeExecutor()
    engine = EngineCore(config, executor)
    for i in range(args.num_requests):
        prompt = [(i * 131 + j) % 32000 for j in range(args.prompt_len)]
        params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0)
        engine.add_request(EngineRequest(f"req-{i}", prompt, params, eos_token_id=None))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()  # prefill everything first: the measured steps are pure decode
    if not args.default_gc:
        tune_gc_for_serving()  # as LLM and SchedulerActor do

    timings = time_steps(engine, executor, args.steps, args.async_scheduling, args.num_requests)
    if timings is None:
        print("error: not every request was scheduled", file=sys.stderr)
        return 1
    sched_t, update_t, total_t = timings
    gc_mode = "default GC" if args.default_gc else "tuned GC"
    mode = "async scheduling" if args.async_scheduling else "sync"
    print(f"{args.num_requests} running decode requests, {args.steps} steps, block size {args.block_size}, {gc_mode}, "
          f"{mode}")  # fmt: skip
    rows = {
        "schedule": summarize("schedule()", sched_t),
        "update_from_output": summarize("update_from_output()", update_t),
        "total": summarize("total", total_t),
    }
    if args.json:
        print(json.dumps({"num_requests": args.num_requests, "steps": args.steps, **rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
