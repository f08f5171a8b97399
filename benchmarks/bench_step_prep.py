"""The host time to prepare a step on CPU, before and after the persistent block table (issue 37).

A worker holds 256 running requests with ~2k-token contexts. Each step: the last step's samples appended to
the worker's copy (as ``ModelRunner._keep_samples`` does), then, timed, what the runner does before the
forward pass: the state updates from the scheduler's diffs (``CachedRequestState.update``; after: also the
block table's ``append``), ``order_decode_first`` and the flattened batch: before, the old per-token builder
(``step_prep_reference.py``, main at 782f002); after, ``build_batch`` over the runner's ``BlockTable`` and
``StepBuffers``. The "mixed" step adds four 512-token prefill chunks of 2k-token prompts. With warm host caches
nothing else runs between steps (a GPU worker, whose forward pass runs on the device); cold, a 32 MiB read
between steps stands in for a CPU forward pass. The two builders run side by side, alternating step by step
on their own copies of the requests (the machine may be shared: the median of many steps is reported).
Prints the medians and their ratio and writes a JSON.

    .venv/bin/python benchmarks/bench_step_prep.py --out-dir benchmarks/results/step_prep
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import describe  # noqa: E402
from step_prep_reference import reference_build_batch  # noqa: E402

from cbserve.scheduler.outputs import CachedRequestData  # noqa: E402
from cbserve.scheduler.requests.sampling_params import SamplingParams  # noqa: E402
from cbserve.worker.cpu.malloc import tune_malloc_for_cpu_inference  # noqa: E402
from cbserve.worker.cpu.native import resolve_isa  # noqa: E402
from cbserve.worker.runner.block_table import BlockTable  # noqa: E402
from cbserve.worker.runner.input_batch import (  # noqa: E402
    CachedRequestState,
    PreparedBatch,
    build_batch,
    order_decode_first,
)
from cbserve.worker.runner.step_buffers import StepBuffers  # noqa: E402

CPU = torch.device("cpu")
GOAL_MS = 1.0


class World:
    """One worker's requests (and, for the new builder, its block table and host buffers)."""

    def __init__(self, states: list[CachedRequestState], sched: dict[str, int], block_size: int, new: bool) -> None:
        self.states = {s.req_id: s for s in copy.deepcopy(states)}
        self.sched, self.block_size, self.new = sched, block_size, new
        self.decodes = [r for r, n in sched.items() if n == 1]
        self.table = BlockTable(len(states), 128) if new else None
        self.buffers = StepBuffers(CPU) if new else None
        self.next_block = 10**6
        if self.table is not None:
            for s in self.states.values():
                self.table.add(s.req_id, s.block_ids)

    def keep_samples(self, tokens: list[int]) -> None:
        """The last step's sampled tokens appended, as ``ModelRunner._keep_samples`` does after the forward."""
        for r, t in zip(self.decodes, tokens, strict=True):
            self.states[r].token_ids.append(t)

    def diffs(self) -> list[CachedRequestData]:
        """The scheduler's diffs for the next decode step: a new block where the new token starts one."""
        out = []
        for r in self.decodes:
            s = self.states[r]
            computed = len(s.token_ids) - 1
            new = []
            if computed >= len(s.block_ids) * self.block_size:
                new, self.next_block = [self.next_block], self.next_block + 1
            out.append(CachedRequestData(r, [], new, computed))
        return out

    def prepare(self, diffs: list[CachedRequestData]) -> PreparedBatch:
        """What the runner does on the host before the forward pass (``_update_states``, then the batch)."""
        for d in diffs:
            self.states[d.req_id].update(d)
            if self.table is not None:
                self.table.append(d.req_id, d.new_block_ids)
        states = order_decode_first([self.states[r] for r in self.sched], self.sched)
        if self.new:
            return build_batch(states, self.sched, self.block_size, CPU, None, self.table, self.buffers)
        return reference_build_batch(states, self.sched, self.block_size, CPU)


def requests(num: int, context: int, num_prefills: int, block_size: int,
             rng: random.Random) -> tuple[list[CachedRequestState], dict[str, int]]:
    """``num`` decoding requests about ``context`` tokens long, and ``num_prefills`` prompts of ``context``
    tokens halfway through their prefill (next, a chunk of 512 tokens or of the half left when shorter), with
    their scheduled token counts."""
    chunk = min(512, context // 2)
    states: list[CachedRequestState] = []
    sched: dict[str, int] = {}
    next_block = 1
    for i in range(num + num_prefills):
        decode = i < num
        n = context + rng.randrange(-64, 64) if decode else context
        computed = n - 1 if decode else context // 2
        nblocks = -(-(computed + (1 if decode else chunk)) // block_size)
        blocks = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        rid = f"{'d' if decode else 'p'}{i}"
        states.append(CachedRequestState(rid, [rng.randrange(32000) for _ in range(n)], min(n, context - 256),
                                         SamplingParams(temperature=0.8, top_p=0.95), blocks, computed))
        sched[rid] = 1 if decode else chunk
    rng.shuffle(states)  # the scheduler's order is not decode-first
    return states, sched


def same(a: PreparedBatch, b: PreparedBatch) -> bool:
    ma, mb = a.metadata, b.metadata
    return all(torch.equal(x, y) for x, y in ((a.input_ids, b.input_ids), (a.positions, b.positions),
                                              (ma.slot_mapping, mb.slot_mapping), (ma.block_tables, mb.block_tables),
                                              (ma.seq_lens, mb.seq_lens), (a.logits_rows, b.logits_rows)))


def run(num: int, context: int, num_prefills: int, block_size: int, repeats: int, seed: int,
        forward_mb: int) -> dict:
    """Steps of both builders, alternating; each step: the last samples kept, the diffs, the timed
    preparation, then a stand-in for the forward pass that leaves the caches cold (``forward_mb`` read)."""
    rng = random.Random(seed)
    states, sched = requests(num, context, num_prefills, block_size, rng)
    worlds = {"before": World(states, sched, block_size, False), "after": World(states, sched, block_size, True)}
    forward = np.ones(forward_mb << 17) if forward_mb else None  # float64: forward_mb MiB
    times: dict[str, list[float]] = {"before": [], "after": []}
    cpu: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(repeats + 10):
        tokens = [rng.randrange(32000) for _ in worlds["after"].decodes]
        batches = {}
        for name in ("before", "after") if rep % 2 else ("after", "before"):
            w = worlds[name]
            if rep:
                w.keep_samples(tokens)
            diffs = w.diffs()
            t0, c0 = time.perf_counter(), time.thread_time()
            batches[name] = w.prepare(diffs)
            if rep >= 10:  # the first ten warm up
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
            if forward is not None:
                forward.sum()
        if not same(batches["before"], batches["after"]):
            raise RuntimeError("the two builders disagree")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    med_cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    after = sorted(times["after"])
    return {"num_requests": num + num_prefills, "num_prefill_chunks": num_prefills,
            "num_tokens": sum(sched.values()), "before_ms": round(med["before"], 4),
            "after_ms": round(med["after"], 4), "speedup": round(med["before"] / med["after"], 2),
            "after_p10_ms": round(after[len(after) // 10] * 1e3, 4),
            "after_p90_ms": round(after[int(0.9 * len(after))] * 1e3, 4),
            "before_cpu_ms": round(med_cpu["before"], 4), "after_cpu_ms": round(med_cpu["after"], 4)}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


CACHES = {"warm": "nothing between steps but the runner's own work (a GPU worker: the forward runs on the device)",
          "cold": "a {mb} MiB read between steps standing in for a CPU forward pass"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256, help="running decode requests")
    ap.add_argument("--context", type=int, default=2048, help="tokens per request")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the step is built on one core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-mb", type=int, default=32, help="MiB read between steps in the cold runs")
    ap.add_argument("--out-dir", type=Path, default=None, help="write step_prep.json here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_malloc_for_cpu_inference()  # as the CPU worker does (model_runner.py)
    load = os.getloadavg()[0]
    machine = describe(resolve_isa("auto"))
    results: dict[str, dict[str, dict]] = {}
    for caches, mb in (("warm", 0), ("cold", args.forward_mb)):
        print(f"host caches {caches}: {CACHES[caches].format(mb=mb)}")
        for name, prefills in (("decode", 0), ("mixed", 4)):
            r = run(args.requests, args.context, prefills, args.block_size, args.repeats, args.seed, mb)
            results.setdefault(caches, {})[name] = r
            print(f"  {name:6s} {r['num_requests']} requests, {r['num_tokens']} tokens: before {r['before_ms']:.3f} "
                  f"ms, after {r['after_ms']:.3f} ms (median of {args.repeats}; p10-p90 {r['after_p10_ms']:.3f}-"
                  f"{r['after_p90_ms']:.3f}), {r['speedup']:.1f}x; CPU time {r['before_cpu_ms']:.3f} -> "
                  f"{r['after_cpu_ms']:.3f} ms")
    met = {c: results[c]["decode"]["after_ms"] <= GOAL_MS for c in results}
    print(f"{machine}, load average {load:.1f} at the start; goal: the {args.requests}-request decode step <= "
          f"{GOAL_MS} ms (median wall time): " + ", ".join(f"{c} {'met' if ok else 'MISSED'}" for c, ok in met.items()))
    report = {"cpu": machine, "load_average": round(load, 2), "commit": commit(), "context": args.context,
              "block_size": args.block_size, "repeats": args.repeats, "forward_mb": args.forward_mb,
              "torch_threads": args.threads, "caches": {c: CACHES[c].format(mb=args.forward_mb) for c in CACHES},
              "goal_ms": GOAL_MS, "goal_met": met, "results": results}
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "step_prep.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
