"""Decode CUDA graphs wired into ModelRunner, checked on CPU against a stand-in for the captured graph.

The stand-in "capture" runs the forward once on the graph's static buffers and returns an object whose
``replay()`` runs it again on the same buffers, as a CUDA graph would. The attention backend is the torch
reference, made graph-safe the way the Triton kernels are: a decode-only step is read from its device
tensors only (the host copies of a graph's static metadata hold worst-case values) and padded rows (slot
-1, seq_len 0) write nothing and read nothing (its real rows are attended with a plan of their own, built by
the backend's builder). A runner with graphs and one with ``enforce_eager`` get the
same scheduler outputs and must sample the same tokens, with the same logprobs and KV cache contents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from graph_testlib import BLOCK, BLOCKS_PER_REQ, Driver, same_output
from worker_testlib import make_tiny_model

from cbserve.worker.attention import AttentionLayout, AttentionMetadata, KVCache, TorchAttentionBackend
from cbserve.worker.config import ModelConfig
from cbserve.worker.cuda.graphs import PAD_SLOT, CaptureFn, maybe_capture_decode_graphs
from cbserve.worker.loading import model_build as model_build_module
from cbserve.worker.runner.model_runner import ModelRunner

MAX_SEQS = 8  # buckets 1, 2, 4, 8


class GraphSafeTorchBackend(TorchAttentionBackend):
    """The torch reference backend, replayable from static buffers: see the module docstring."""

    supports_cuda_graphs = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        md = metadata
        if md.num_decodes != md.seq_lens.shape[0]:  # prefill chunks: eager only, host fields are exact
            return super().forward(q, k, v, kv_cache, md)
        lens = md.seq_lens.tolist()
        real = [i for i, n in enumerate(lens) if n > 0]
        assert all(md.slot_mapping[i] == PAD_SLOT for i, n in enumerate(lens) if n == 0)
        rows = torch.tensor(real, dtype=torch.long)
        sub = AttentionMetadata(
            slot_mapping=md.slot_mapping[rows], block_tables=md.block_tables[rows], seq_lens=md.seq_lens[rows],
            query_start_loc=torch.arange(len(real) + 1, dtype=torch.int32), num_decodes=len(real),
            max_query_len=1, max_seq_len=max(lens), block_size=md.block_size, query_lens_cpu=[1] * len(real),
            seq_lens_cpu=[lens[i] for i in real],
        )
        layout = AttentionLayout(self.num_heads, self.num_kv_heads, self.head_dim, q.dtype, q.device)
        sub.prepared = self.make_builder(layout).build(sub)
        out = torch.zeros_like(q)
        out[rows] = super().forward(q[rows], k[rows], v[rows], kv_cache, sub)
        return out


@dataclass
class StandInGraph:
    """Replays ``forward`` eagerly into the output tensor captured with it; logs its bucket size."""

    forward: Callable[[], torch.Tensor]
    out: torch.Tensor
    log: list[int]

    def replay(self) -> None:
        self.log.append(self.out.shape[0])
        self.out.copy_(self.forward())


def stand_in_capture(log: list[int]) -> CaptureFn:
    def capture(forward: Callable[[], torch.Tensor], pool: object) -> tuple[StandInGraph, torch.Tensor]:
        out = forward()
        return StandInGraph(forward, out, log), out

    return capture


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_graphs"), "llama_gqa")


@pytest.fixture
def graph_safe_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_build_module, "get_attention_backend", lambda *a, **k: GraphSafeTorchBackend)


def _runner(folder: Path, enforce_eager: bool, log: list[int]) -> ModelRunner:
    cfg = ModelConfig(model=str(folder), cpu_ops="torch", enforce_eager=enforce_eager, device="cpu")
    r = ModelRunner(dataclasses.replace(cfg, block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=MAX_SEQS),
                    progress=False)
    r.init_kv_cache(64, capture=stand_in_capture(log))
    return r


PROMPTS = {r: [(7 * i + 3 * j) % 300 + 5 for j in range(3 + i)] for i, r in enumerate("abcdefghi")}
STEPS = [  # (requests scheduled, bucket replayed or None for an eager step)
    ("abc", None),  # prefills
    ("abc", 4),  # 3 decodes: bucket 4, one padded row
    ("abcd", None),  # decodes + a prefill: mixed, eager
    ("abcd", 4),
    ("efgh", None),
    ("abcdefgh", 8),
    ("abefg", 8),  # 5 decodes: bucket 8, three padded rows
    ("i", None),
    ("abcdefghi", None),  # 9 decodes: more than the largest bucket, eager
    ("c", 1),
    ("ab", 2),
]


def _check_padding(runner: ModelRunner, n: int, bucket: int) -> None:
    g = runner.graphs
    assert g is not None and g.bucket(n) == bucket
    assert g._slots[n:bucket].tolist() == [PAD_SLOT] * (bucket - n)
    assert g._seq_lens[n:bucket].tolist() == [0] * (bucket - n)
    assert g._input_ids[n:bucket].tolist() == [0] * (bucket - n)
    assert g._positions[n:bucket].tolist() == [0] * (bucket - n)
    assert (g._seq_lens[:n] > 0).all() and (g._slots[:n] >= 0).all()


@pytest.mark.usefixtures("graph_safe_backend")
def test_decode_steps_replay_padded_buckets_token_for_token(folder: Path) -> None:
    graph_log: list[int] = []
    eager_log: list[int] = []
    graphed, eager = _runner(folder, False, graph_log), _runner(folder, True, eager_log)
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8]
    assert eager.graphs is None  # enforce_eager: nothing captured, nothing replayed
    assert graph_log == [] and all(torch.count_nonzero(k) == 0 for k, _ in graphed.kv_caches), \
        "capture must not write the KV cache"
    drive = Driver(PROMPTS)
    for step, (rids, bucket) in enumerate(STEPS):
        so = drive.schedule(list(rids))
        before = len(graph_log)
        got = graphed.execute_model(so)
        want = eager.execute_model(so)
        assert graph_log[before:] == ([] if bucket is None else [bucket]), f"step {step}"
        if bucket is not None:
            _check_padding(graphed, len(rids), bucket)
        same_output(got, want)
        drive.update(so, got)
    assert eager_log == []
    for (kg, vg), (ke, ve) in zip(graphed.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(kg, ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vg, ve, atol=1e-5, rtol=1e-5)
    unused = len(PROMPTS) * BLOCKS_PER_REQ
    assert all(torch.count_nonzero(k[unused:]) == 0 for k, _ in graphed.kv_caches), "padding wrote the cache"


def test_no_graphs_without_support_or_with_enforce_eager(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[int] = []
    plain = _runner(folder, False, log)  # the torch backend declares no graph support
    assert plain.graphs is None
    monkeypatch.setattr(model_build_module, "get_attention_backend", lambda *a, **k: GraphSafeTorchBackend)
    eager = _runner(folder, True, log)
    assert eager.graphs is None and maybe_capture_decode_graphs(eager, stand_in_capture(log)) is None
    graphed = _runner(folder, False, log)
    assert graphed.graphs is not None
    graphed.init_kv_cache(32)  # real CUDA capture requested: off on CPU, and no stale graph survives
    assert graphed.graphs is None
    assert maybe_capture_decode_graphs(graphed) is None
    graphed.init_kv_cache(32, capture=stand_in_capture(log))
    assert graphed.graphs is not None and graphed.graphs.max_batch == MAX_SEQS
    graphed.shutdown()
    assert graphed.graphs is None and log == []
