"""The step builder on the persistent block table (worker/runner/block_table.py, worker/runner/step_buffers.py,
input_batch.build_batch) equals the old per-token builder (benchmarks/step_prep_reference.py) field by field,
on random mixes of decodes, prefill chunks, drafts, prompt logprobs, n > 1 fork points, requests coming and
going and rollbacks; the table keeps zero padding as it grows and shrinks; the host buffers are reused only
once their copy is done and never alias an earlier step's tensors."""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from cbserve.scheduler.outputs import CachedRequestData, NewRequestData
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.runner import input_batch
from cbserve.worker.runner.block_table import BlockTable
from cbserve.worker.runner.input_batch import CachedRequestState, PreparedBatch, build_batch, order_decode_first
from cbserve.worker.runner.step_buffers import StepBuffers

BS = 4
CPU = torch.device("cpu")
Builder = Callable[..., PreparedBatch]


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch) -> Builder:
    """The old builder, from benchmarks/step_prep_reference.py."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    return importlib.import_module("step_prep_reference").reference_build_batch  # type: ignore[no-any-return]


def assert_same(new: PreparedBatch, old: PreparedBatch) -> None:
    """Every field of two batches equal (tensors: dtype, shape and values)."""
    pairs = [(new.input_ids, old.input_ids), (new.positions, old.positions), (new.logits_rows, old.logits_rows)]
    a, b = new.metadata, old.metadata
    pairs += [(a.slot_mapping, b.slot_mapping), (a.block_tables, b.block_tables), (a.seq_lens, b.seq_lens),
              (a.query_start_loc, b.query_start_loc)]
    for x, y in pairs:
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (x, y)
    for name in ("num_decodes", "max_query_len", "max_seq_len", "block_size", "query_lens_cpu", "seq_lens_cpu",
                 "decode_num_splits", "prepared"):
        assert getattr(a, name) == getattr(b, name), name
    assert type(a.max_seq_len) is int and all(type(x) is int for x in a.seq_lens_cpu)
    for name in ("sampled_req_ids", "sample_owner", "sample_rows", "prompt_lp", "draft_groups"):
        assert getattr(new, name) == getattr(old, name), name


class Sim:
    """A worker's requests and block table driven as the runner drives them, by random scheduler outputs."""

    def __init__(self, rng: random.Random, p_drafts: float, p_logprobs: float) -> None:
        self.rng, self.p_drafts, self.p_logprobs = rng, p_drafts, p_logprobs
        self.states: dict[str, CachedRequestState] = {}
        self.table = BlockTable(2, 2)  # tiny: rows and columns grow
        self.preempted: list[CachedRequestState] = []
        self.count = 0

    def _blocks(self, k: int) -> list[int]:
        return [self.rng.randrange(1, 5000) for _ in range(k)]

    def arrive(self) -> None:
        r = self.rng
        if self.preempted and r.random() < 0.3:  # resumed: prompt + generated, recomputed from 0
            old = self.preempted.pop()
            tokens, n_prompt, sp, seed = old.token_ids, old.num_prompt_tokens, old.sampling_params, old.seed
            samples, computed = 1, 0
        else:
            n_prompt = r.randint(1, 40)
            tokens = [r.randrange(100) for _ in range(n_prompt)]
            sp = SamplingParams(prompt_logprobs=r.choice([0, 2]) if r.random() < self.p_logprobs else None)
            samples, seed = r.choice([1, 1, 1, 3]), r.choice([None, 7])
            computed = BS * r.randint(0, (n_prompt - 1) // BS)  # a prefix-cache hit of whole blocks
        self.count += 1
        d = NewRequestData(f"r{self.count}", list(tokens), n_prompt, sp, self._blocks(-(-computed // BS)),
                           computed, samples, seed)
        self.states[d.req_id] = CachedRequestState.from_new(d)
        self.table.add(d.req_id, d.block_ids)

    def schedule(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Tokens to compute per request (new blocks sent as the runner receives them) and drafts."""
        r = self.rng
        sched: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        for rid, s in self.states.items():
            if r.random() < 0.15:
                continue
            c, known = s.num_computed_tokens, len(s.token_ids)
            if c < known - 1:
                n = r.choice([known - c, r.randint(1, known - c)])
            elif r.random() < self.p_drafts:
                spec[rid] = [r.randrange(100) for _ in range(r.randint(1, 3))]
                n = 1 + len(spec[rid])
            else:
                n = 1
            need = -(-(c + n) // BS) - len(s.block_ids) + r.choice([0, 0, 1])  # sometimes a block ahead
            s.update(CachedRequestData(rid, [], self._blocks(max(0, need)), c))
            self.table.append(rid, s.block_ids[len(s.block_ids) - max(0, need):])
            sched[rid] = n
        return sched, spec

    def finish_step(self, batch: PreparedBatch, sched: dict[str, int], spec: dict[str, list[int]]) -> None:
        """Samples kept as ``ModelRunner._keep_samples`` keeps them (rollback included); some requests leave."""
        r = self.rng
        for rid, n in sched.items():
            self.states[rid].num_computed_tokens += n
        for rid in batch.sampled_req_ids:
            s = self.states[rid]
            if rid in spec:
                s.token_ids.extend(spec[rid][: r.randint(0, len(spec[rid]))] + [r.randrange(100)])
                s.num_computed_tokens = len(s.token_ids) - 1
                keep = -(-len(s.token_ids) // BS)
                del s.block_ids[keep:]
                self.table.truncate(rid, keep)
            else:
                s.token_ids.append(r.randrange(100))
        for rid in list(self.states):
            if r.random() < 0.08:
                s = self.states.pop(rid)
                self.table.remove(rid)
                if r.random() < 0.5:
                    self.preempted.append(s)

    def check_table(self) -> None:
        for rid, s in self.states.items():
            assert self.table.row(rid) == s.block_ids
        held = set(self.table.row_of.values())
        for row in range(self.table.blocks.shape[0]):
            length = int(self.table.lens[row])
            assert not self.table.blocks[row, length:].any()  # zero padding
            assert row in held or length == 0


@pytest.mark.parametrize("seed", range(6))
def test_new_builder_equals_the_old_one_on_random_mixes(reference: Builder, seed: int) -> None:
    rng = random.Random(seed)
    sim = Sim(rng, *[(0.3, 0.4), (0.02, 0.02)][seed % 2])  # odd seeds: mostly plain decodes (the fast path)
    buffers = StepBuffers(CPU, copy=seed < 3)  # staged through the host buffer as on CUDA, or not
    for _step in range(60):
        for _ in range(rng.randint(0, 3)):
            sim.arrive()
        sched, spec = sim.schedule()
        sim.check_table()
        if not sched:
            continue
        states = [sim.states[r] for r in sched]
        if rng.random() < 0.8:
            states = order_decode_first(states, sched)
        else:
            rng.shuffle(states)  # any order is flattened as given
        kept = {r: spec[r] for r in sched if r in spec}
        new = build_batch(states, sched, BS, CPU, kept, sim.table, buffers)
        assert_same(new, reference(states, sched, BS, CPU, kept))
        assert_same(build_batch(states, sched, BS, CPU, kept), new)  # a table of their own
        sim.finish_step(new, sched, kept)
    sim.check_table()


def _decoding(num: int, ctx: int, rng: random.Random) -> tuple[list[CachedRequestState], BlockTable]:
    table = BlockTable()
    states = []
    for i in range(num):
        n = ctx + rng.randint(0, 30)
        blocks = [rng.randrange(1, 10**6) for _ in range(-(-n // BS) + rng.randint(0, 1))]
        states.append(CachedRequestState(f"d{i}", [rng.randrange(100) for _ in range(n)], ctx // 2,
                                         SamplingParams(), blocks, n - 1, seed=rng.choice([None, 3])))
        table.add(states[-1].req_id, blocks)
    return states, table


def test_decode_steps_take_the_fast_path_and_equal_the_old_builder(reference: Builder) -> None:
    rng = random.Random(1)
    states, table = _decoding(64, 50, rng)
    sched = {s.req_id: 1 for s in states}
    batch = build_batch(states, sched, BS, CPU, None, table)
    assert_same(batch, reference(states, sched, BS, CPU))
    assert batch.sample_rows[0] is states[0].sample_row()  # each state's row, reused
    assert input_batch._plan(states, sched, BS, None, table).head is not None  # the fast path
    # a decode at its fork point (the general path); one asking for prompt logprobs (none left to score)
    fork = CachedRequestState("fork", [1, 2, 3], 3, SamplingParams(), [9], 2, num_samples=3, seed=5)
    lp = CachedRequestState("lp", [1, 2, 3, 4], 4, SamplingParams(prompt_logprobs=1), [8], 3)
    for extra in (fork, lp):
        table.add(extra.req_id, extra.block_ids)
        both = [*states, extra]
        sched = {s.req_id: 1 for s in both}
        batch = build_batch(both, sched, BS, CPU, {}, table)
        assert_same(batch, reference(both, sched, BS, CPU, {}))
        assert (input_batch._plan(both, sched, BS, {}, table).head is not None) == (extra is lp)  # fast path


@pytest.mark.parametrize(("n", "spec", "blocks"), [(0, {}, 1), (3, {}, 1), (1, {}, 0), (1, {"x": [5]}, 2),
                                                   (2, {"x": [5, 6]}, 2)])
def test_bad_steps_are_refused_as_before(reference: Builder, n: int, spec: dict[str, list[int]],
                                         blocks: int) -> None:
    s = CachedRequestState("x", [1, 2, 3, 4, 5], 5, SamplingParams(), list(range(1, blocks + 1)), 4)
    with pytest.raises(ValueError) as old:
        reference([s], {"x": n}, BS, CPU, spec)
    with pytest.raises(ValueError, match=str(old.value)):
        build_batch([s], {"x": n}, BS, CPU, spec, BlockTable.of([("x", s.block_ids)]))


def test_block_table_grows_and_keeps_zero_padding() -> None:
    t = BlockTable(1, 1)
    t.add("a", [5, 6, 7])
    t.add("b", [1])
    t.append("b", [2, 3, 4, 8])
    assert t.blocks.shape[0] >= 2 and t.row("a") == [5, 6, 7] and t.row("b") == [1, 2, 3, 4, 8]
    t.truncate("b", 2)
    t.remove("a")
    assert t.row("b") == [1, 2] and not t.blocks[t.row_of["b"], 2:].any() and not t.blocks[0].any()
    t.add("c", [4])  # takes a's freed row
    assert t.row_of["c"] == 0 and t.gather(np.array([0, 1]), 3).tolist() == [[4, 0, 0], [1, 2, 0]]
    t.add("c", [9, 9])  # a request id again: replaced
    assert t.row("c") == [9, 9] and len(t) == 2 and "a" not in t
    with pytest.raises(ValueError):
        BlockTable(0, 4)


class FakeEvent:
    """Stands in for a CUDA event: records the order of records and waits."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log, self.id = log, sum(1 for what, _ in log if what == "record")

    def record(self) -> None:
        self.log.append(("record", self.id))

    def synchronize(self) -> None:
        self.log.append(("wait", self.id))


def test_step_buffers_wait_for_a_buffers_last_copy_and_never_alias() -> None:
    log: list[tuple[str, int]] = []
    bufs = StepBuffers(CPU, pin=False, new_event=lambda: FakeEvent(log), copy=True)  # the CUDA path's logic
    steps = [[np.arange(k, k + 5, dtype=np.int64), np.full((2, 3), k, dtype=np.int32),
              np.array([], dtype=np.int64)] for k in range(4)]
    out = [bufs.stage(arrays) for arrays in steps]
    assert log == [("record", 0), ("record", 1), ("wait", 0), ("record", 2), ("wait", 1), ("record", 3)]
    for arrays, tensors in zip(steps, out, strict=True):  # each step's tensors kept their values
        for a, t in zip(arrays, tensors, strict=True):
            assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
            assert torch.equal(t, torch.from_numpy(a))
    big = bufs.stage([np.arange(10_000, dtype=np.int64)])[0]  # the buffer grows
    assert torch.equal(big, torch.arange(10_000))
    plain = StepBuffers(CPU)  # on the CPU by default: the arrays themselves, no copy
    arrays = steps[0]
    assert not plain.copy and all(t.data_ptr() == a.ctypes.data for t, a in zip(plain.stage(arrays), arrays,
                                                                                 strict=True) if a.size)


def test_the_benchmark_runs_and_writes_its_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    bench = importlib.import_module("bench_step_prep")
    assert bench.main(["--requests", "8", "--context", "600", "--repeats", "3", "--forward-mb", "1",
                       "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_prep.json").read_text())
    for caches in ("warm", "cold"):
        for step in ("decode", "mixed"):
            r = report["results"][caches][step]
            assert r["before_ms"] > 0 and r["after_ms"] > 0 and r["num_requests"] == 8 + 4 * (step == "mixed")
    assert set(report["goal_met"]) == {"warm", "cold"} and report["cpu"]
