"""Piecewise CUDA graphs (``cudagraph_mode: full_and_piecewise``) wired into ModelRunner, checked on CPU against
a stand-in for the captured pieces.

The stand-in "capture" runs a piece once and returns an object whose ``replay()`` runs it again: a piece reads
and writes only static buffers allocated before capture, so rerunning it is what replaying its graph does. A
runner with piecewise graphs and one with ``enforce_eager`` get the same scheduler outputs (prefills, decodes
and mixed steps) and must sample the same tokens, with the same logprobs and KV cache
contents; every step of up to the largest bucket replays each of its bucket's pieces once, larger steps run
eagerly. Families whose layers differ most (Gemma 2's sandwich norms, windows and soft-caps, Gemma 3's local
rope, Qwen 3's per-head q/k norms, Phi-3's fused projections) are cut and replayed too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from family_testlib import make_family_model
from graph_testlib import BLOCKS_PER_REQ, Driver, same_output
from moe_testlib import make_tiny_moe
from test_cuda_graphs_runner import GraphSafeTorchBackend, stand_in_capture
from worker_testlib import make_tiny_model

from cbserve.worker.config import ModelConfig
from cbserve.worker.cuda.piecewise_graphs import PieceCaptureFn, maybe_capture_piecewise_graphs, piecewise_sizes
from cbserve.worker.loading import model_build as model_build_module
from cbserve.worker.runner.model_runner import ModelRunner

BLOCK = 4
MAX_TOKENS = 16  # buckets 1, 2, 4, 8, 16


@dataclass
class StandInPiece:
    """Replays a piece by running it again: it writes only the static buffers, as its CUDA graph would."""

    forward: Callable[[], None]
    bucket: int
    log: list[int]

    def replay(self) -> None:
        self.log.append(self.bucket)
        self.forward()


def stand_in_pieces(log: list[int]) -> PieceCaptureFn:
    def capture(forward: Callable[[], None], pool: object) -> tuple[StandInPiece, None]:
        forward()
        # the bucket: the rows of the static residual buffer the piece reads (its closure's view)
        return StandInPiece(forward, _bucket_of(forward), log), None

    return capture


def _bucket_of(piece: Callable[[], None]) -> int:
    cells = [c.cell_contents for c in piece.__closure__ or ()]
    return next(int(c.shape[0]) for c in cells if isinstance(c, torch.Tensor))


def _runner(folder: Path, log: list[int], *, eager: bool = False, mode: str = "full_and_piecewise",
            decode_log: list[int] | None = None) -> ModelRunner:
    cfg = ModelConfig(model=str(folder), cpu_ops="torch", enforce_eager=eager, device="cpu",
                      cudagraph_mode=mode)  # type: ignore[arg-type]
    r = ModelRunner(dataclasses.replace(cfg, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8),
                    progress=False)
    r.init_kv_cache(64, capture=stand_in_capture(decode_log if decode_log is not None else []),
                    piece_capture=stand_in_pieces(log))
    return r


PROMPTS = {r: [(5 * i + 3 * j) % 250 + 7 for j in range(2 + i)] for i, r in enumerate("abcdefg")}
# (requests scheduled, tokens in the step): prefills, decodes, mixed steps; 19 tokens: eager
STEPS = [("ab", 5), ("abc", 6), ("abcd", 8), ("de", 7), ("abcdef", 12), ("abcdefg", 14), ("ab", 2), ("g", 1),
         ("abcdefg", 7)]


def _drive(graphed: ModelRunner, eager: ModelRunner, log: list[int], layers: int,
           steps: list[tuple[str, int]], decode_log: list[int] | None = None) -> None:
    drive = Driver(PROMPTS)
    for step, (rids, tokens) in enumerate(steps):
        so = drive.schedule(list(rids))
        assert so.total_num_scheduled_tokens == tokens, step
        before, decode_before = len(log), len(decode_log or [])
        got = graphed.execute_model(so)
        same_output(got, eager.execute_model(so))
        replayed = log[before:]
        decode_graph = decode_log is not None and len(decode_log) > decode_before
        if tokens > MAX_TOKENS or decode_graph:
            assert replayed == [], f"step {step}: {replayed}"
        else:
            bucket = graphed.piecewise.bucket(tokens)  # type: ignore[union-attr]
            assert replayed == [bucket] * (layers + 1), f"step {step}"
            assert graphed.piecewise._input_ids[tokens:bucket].tolist() == [0] * (bucket - tokens)  # type: ignore[union-attr]
        drive.update(so, got)
    for (kg, vg), (ke, ve) in zip(graphed.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(kg, ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vg, ve, atol=1e-5, rtol=1e-5)
    unused = len(PROMPTS) * BLOCKS_PER_REQ
    assert all(torch.count_nonzero(k[unused:]) == 0 for k, _ in graphed.kv_caches), "padding wrote the cache"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_pieces"), "llama_gqa")


def test_piecewise_sizes() -> None:
    assert piecewise_sizes(1) == [1]
    assert piecewise_sizes(16) == [1, 2, 4, 8, 16]
    sizes = piecewise_sizes(512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and 256 in sizes and 288 in sizes and sizes[-1] == 512
    assert piecewise_sizes(300)[-1] == 300
    with pytest.raises(ValueError, match="positive"):
        piecewise_sizes(0)


def test_mixed_steps_replay_pieces_token_for_token(folder: Path) -> None:
    """The torch backend (no graph support of its own: the attention runs between the pieces) through
    prefills, decodes and mixed steps, each replaying its bucket's pieces; 19 tokens run eagerly."""
    log: list[int] = []
    graphed, eager = _runner(folder, log), _runner(folder, log, eager=True)
    assert graphed.graphs is None and graphed.piecewise is not None and eager.piecewise is None
    assert graphed.piecewise.sizes == [1, 2, 4, 8, 16]
    assert log == [] and all(torch.count_nonzero(k) == 0 for k, _ in graphed.kv_caches)
    layers = len(graphed.model.model.layers)
    _drive(graphed, eager, log, layers, STEPS + [("abcdefg", 7)])
    assert len(log) > 0


def test_decode_graphs_and_pieces_together(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a backend that supports full graphs: decode-only steps replay the decode graphs, the others the
    pieces."""
    monkeypatch.setattr(model_build_module, "get_attention_backend", lambda *a, **k: GraphSafeTorchBackend)
    log: list[int] = []
    decode_log: list[int] = []
    graphed = _runner(folder, log, decode_log=decode_log)
    eager = _runner(folder, [], eager=True)
    assert graphed.graphs is not None and graphed.piecewise is not None
    _drive(graphed, eager, log, len(graphed.model.model.layers), STEPS, decode_log)
    assert decode_log and log  # both kinds replayed


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3", "phi3_short"])
def test_families_cut_at_attention(tmp_path: Path, family: str) -> None:
    folder = make_family_model(tmp_path, family)
    log: list[int] = []
    graphed, eager = _runner(folder, log), _runner(folder, [], eager=True)
    _drive(graphed, eager, log, len(graphed.model.model.layers), STEPS[:5])


def test_no_pieces_where_the_forward_cannot_be_captured(tmp_path: Path) -> None:
    """The CPU's mixture-of-experts path syncs with the host (its blocker is lifted on CUDA only)."""
    runner = _runner(make_tiny_moe(tmp_path, "mixtral"), [])
    assert runner.model.cuda_graphs_blocker and runner.piecewise is None


def test_piecewise_only_when_asked(folder: Path) -> None:
    log: list[int] = []
    assert _runner(folder, log, mode="full_decode_only").piecewise is None
    assert _runner(folder, log, eager=True).piecewise is None
    graphed = _runner(folder, log)
    assert graphed.piecewise is not None
    graphed.init_kv_cache(32)  # real CUDA capture requested: nothing on CPU, and no stale pieces survive
    assert graphed.piecewise is None and maybe_capture_piecewise_graphs(graphed) is None
    graphed.init_kv_cache(32, piece_capture=stand_in_pieces(log))
    assert graphed.piecewise is not None and graphed.piecewise.max_tokens == MAX_TOKENS
    graphed.shutdown()
    assert graphed.piecewise is None and log == []
    with pytest.raises(ValueError, match="cudagraph_mode"):
        ModelConfig(cudagraph_mode="piecewise", device="cpu")  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_piecewise_graphs_equal_eager(folder: Path) -> None:
    """Real CUDA graphs of the pieces (Triton attention between them, float32: no TF32) against an eager runner
    on the same GPU, through the same prefills, decodes and mixed steps."""

    def runner(eager: bool) -> ModelRunner:
        cfg = ModelConfig(model=str(folder), device="cuda", dtype="float32", enforce_eager=eager,
                          cudagraph_mode="full_and_piecewise")
        r = ModelRunner(dataclasses.replace(cfg, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                                            max_num_seqs=8), progress=False)
        r.init_kv_cache(64)
        return r

    graphed, eager = runner(False), runner(True)
    assert graphed.piecewise is not None and graphed.piecewise.sizes == [1, 2, 4, 8, 16]
    drive = Driver(PROMPTS)
    for rids, _ in STEPS:
        so = drive.schedule(list(rids))
        got = graphed.execute_model(so)
        same_output(got, eager.execute_model(so))
        drive.update(so, got)
    for (kg, vg), (ke, ve) in zip(graphed.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(kg, ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vg, ve, atol=1e-5, rtol=1e-5)
