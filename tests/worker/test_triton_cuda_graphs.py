"""Decode CUDA graphs: bucket sizes, the off switch, and the static-buffer staging (padding with slot -1 /
seq_len 0) checked against an eager run of a tiny attention-only "model" on the Triton backend.

On CPU the graph is replaced by an eager replay of the same static buffers (the staging logic is what can
go wrong); on CUDA real graphs are captured and replayed.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit decorators running
pytest.importorskip("triton")

from cbserve.worker.attention import AttentionLayout, AttentionMetadata, TorchAttentionBackend  # noqa: E402
from cbserve.worker.cuda.graphs import DecodeCUDAGraphs, capture_sizes, graphs_supported  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.cuda  # the GPU suite (`pytest -m cuda`): compiled on CUDA, interpreted on CPU
DTYPE = torch.bfloat16 if CUDA else torch.float32
ATOL = 2e-2 if CUDA else 1e-5
HQ, HKV, D, BS, VOCAB = 4, 2, 64, 16, 50


@pytest.fixture(scope="module")
def backend(triton_kernels_module):
    from cbserve.worker.attention import triton_backend

    return triton_backend.TritonAttentionBackend(HQ, HKV, D, D ** -0.5)


class _EagerReplay:
    """Stands in for a CUDA graph on CPU: replay() reruns the forward on the same static buffers."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def _eager_capture(forward, pool):
    out = forward()
    return _EagerReplay(forward, out), out


@pytest.fixture(scope="module")
def builder(backend):
    """The Triton backend's metadata builder, as the model runner makes it for this tiny model."""
    return type(backend).make_builder(AttentionLayout(HQ, HKV, D, DTYPE, DEVICE))


def _tiny_model(backend, builder=None):
    """An attention-only "model"; with ``builder`` it plans an eager step itself, as the runner would (the
    graphs' static metadata is planned at capture)."""
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randn(VOCAB, h, D, generator=gen).to(DTYPE).to(DEVICE) for h in (HQ, HKV, HKV)]

    def model(input_ids, positions, kv_caches, md):
        if builder is not None and md.prepared is None:
            md.prepared = builder.build(md)
        q, k, v = (t[input_ids] + positions[:, None, None].to(DTYPE) * 0.01 for t in tables)
        return backend.forward(q, k, v, kv_caches[0], md).flatten(1)

    return model


def _decode_md(seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    slots = [t[(s - 1) // BS] * BS + (s - 1) % BS for s, t in zip(seq_lens, tables, strict=True)]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
        seq_lens=torch.tensor(seq_lens, **i32), query_start_loc=torch.arange(n + 1, **i32),
        num_decodes=n, max_query_len=1, max_seq_len=max(seq_lens), block_size=BS,
        query_lens_cpu=[1] * n, seq_lens_cpu=list(seq_lens),
    )


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_graphs_off_on_cpu_eager_and_torch_backend() -> None:
    from cbserve.worker.attention.triton_backend import TritonAttentionBackend

    assert not graphs_supported(torch.device("cpu"), TritonAttentionBackend, False)
    assert not graphs_supported(torch.device("cuda"), TritonAttentionBackend, True)
    assert not graphs_supported(torch.device("cuda"), TorchAttentionBackend, False)
    assert graphs_supported(torch.device("cuda"), TritonAttentionBackend, False)


def test_padded_replay_matches_eager(backend, builder) -> None:
    model = _tiny_model(backend, builder)
    num_blocks, max_len = 24, 128
    gen = torch.Generator().manual_seed(1)
    cache = [(torch.randn(num_blocks, BS, HKV, D, generator=gen).to(DTYPE).to(DEVICE),
              torch.randn(num_blocks, BS, HKV, D, generator=gen).to(DTYPE).to(DEVICE))]
    eager_cache = [(cache[0][0].clone(), cache[0][1].clone())]
    kw = {} if CUDA else {"capture": _eager_capture}
    graphs = DecodeCUDAGraphs(model, cache, max_batch=8, max_model_len=max_len, block_size=BS,
                              build_attention=builder.build, device=DEVICE, sizes=[1, 4, 8], **kw)
    graphs.capture()
    assert torch.equal(cache[0][0], eager_cache[0][0]), "capture must not write the KV cache"
    steps = [  # (seq_lens, block tables): 5 decodes (bucket 8), then 3 (bucket 4), then 6 (bucket 8)
        ([17, 40, 3, 100, 64], [[0, 1], [2, 3, 4], [5], [6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16]]),
        ([18, 41, 4], [[0, 1], [2, 3, 4], [5]]),
        ([5, 1, 33, 16, 2, 9], [[17], [18], [19, 20, 21], [22], [23], [5]]),
    ]
    for step, (lens, tables) in enumerate(steps):
        md = _decode_md(lens, tables)
        ids = torch.randint(0, VOCAB, (len(lens),), generator=gen).to(DEVICE)
        pos = torch.tensor([s - 1 for s in lens], dtype=torch.long, device=DEVICE)
        assert graphs.can_run(len(lens), md)
        got = graphs.run(ids, pos, md).clone()
        want = model(ids, pos, eager_cache, _decode_md(lens, tables))
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=ATOL, msg=f"step {step}")
        torch.testing.assert_close(cache[0][0].float(), eager_cache[0][0].float(), atol=0, rtol=0)
        torch.testing.assert_close(cache[0][1].float(), eager_cache[0][1].float(), atol=0, rtol=0)


def test_can_run_rejects_prefill_and_oversize(backend, builder) -> None:
    graphs = DecodeCUDAGraphs(_tiny_model(backend), [], max_batch=4, max_model_len=64, block_size=BS,
                              build_attention=builder.build, device=DEVICE, sizes=[1, 4])
    md = _decode_md([3, 4], [[0], [1]])
    assert not graphs.can_run(2, md)  # nothing captured yet
    graphs._replays[4] = (None, None)
    assert graphs.can_run(2, md)
    assert not graphs.can_run(5, _decode_md([3] * 5, [[0]] * 5))
    md.num_decodes = 1  # a prefill in the batch
    assert not graphs.can_run(2, md)
    with pytest.raises(ValueError):
        graphs.run(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), md)
