"""TritonAttentionBackend against TorchAttentionBackend on a mixed decode + prefill batch.

CPU: the Triton kernels run under ``TRITON_INTERPRET=1`` (fp32, small sizes); CUDA: natively in bf16.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit decorators running
pytest.importorskip("triton")
from worker_testlib import build_plan, fused_qkv, paged_metadata  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.cuda  # the GPU suite (`pytest -m cuda`): compiled on CUDA, interpreted on CPU
DTYPE = torch.bfloat16 if CUDA else torch.float32
ATOL, RTOL = (2e-2, 2e-2) if CUDA else (2e-4, 2e-4)


@pytest.fixture(scope="module")
def backend_cls(triton_kernels_module):
    from cbserve.worker.attention import triton_backend

    return triton_backend.TritonAttentionBackend


def _metadata(ctx_q: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator,
              pad_decodes: int = 0):
    return paged_metadata(ctx_q, block_size, num_blocks, gen, DEVICE, pad_decodes)


def _qkv(num_tokens: int, hq: int, hkv: int, d: int, gen: torch.Generator):
    return fused_qkv(num_tokens, hq, hkv, d, gen, DTYPE, DEVICE)


@pytest.mark.parametrize("hq,hkv,d,block_size", [(9, 3, 64, 16), (8, 8, 128, 32), (8, 1, 64, 1)])
def test_matches_torch_backend_mixed_batch(backend_cls, hq: int, hkv: int, d: int, block_size: int) -> None:
    from cbserve.worker.attention import TorchAttentionBackend

    gen = torch.Generator().manual_seed(hq * 100 + block_size)
    # decodes, then: fresh prompt, prefix-cache hit, later chunk of a chunked prefill
    ctx_q = [(20, 1), (3, 1), (70, 1), (0, 25), (32, 9), (17, 40)]
    num_blocks = sum(-(-(c + q) // block_size) for c, q in ctx_q) + 4
    md_t = _metadata(ctx_q, block_size, num_blocks, gen)
    md_r = _metadata(ctx_q, block_size, num_blocks, torch.Generator().manual_seed(hq * 100 + block_size))
    shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(DTYPE).to(DEVICE)  # prefixes: random cached K/V
    v_cache = torch.randn(shape, generator=gen).to(DTYPE).to(DEVICE)
    q, k, v = _qkv(int(md_t.query_start_loc[-1]), hq, hkv, d, gen)
    triton_be = backend_cls(hq, hkv, d, d ** -0.5)
    torch_be = TorchAttentionBackend(hq, hkv, d, d ** -0.5)
    cache_t = (k_cache.clone(), v_cache.clone())
    cache_r = (k_cache.clone(), v_cache.clone())
    build_plan(triton_be, md_t, DTYPE, DEVICE)
    build_plan(torch_be, md_r, DTYPE, DEVICE)
    out_t = triton_be.forward(q, k, v, cache_t, md_t)
    out_r = torch_be.forward(q, k, v, cache_r, md_r)
    assert torch.equal(cache_t[0], cache_r[0]) and torch.equal(cache_t[1], cache_r[1])
    torch.testing.assert_close(out_t.float(), out_r.float(), atol=ATOL, rtol=RTOL)


def test_padded_decode_rows_and_fixed_splits(backend_cls) -> None:
    """CUDA-graph style batch: padded rows (slot -1, seq_len 0) leave the cache alone and give zeros; a
    preset split count (as a graph runner sets it) is respected."""
    from cbserve.worker.attention import TorchAttentionBackend

    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 64, 16
    ctx_q = [(30, 1), (0, 1), (47, 1)]
    md = _metadata(ctx_q, bs, 12, gen, pad_decodes=3)
    md.decode_num_splits = 4
    md_ref = _metadata(ctx_q, bs, 12, torch.Generator().manual_seed(5))
    k_cache = torch.randn(12, bs, hkv, d, generator=gen).to(DTYPE).to(DEVICE)
    v_cache = torch.randn(12, bs, hkv, d, generator=gen).to(DTYPE).to(DEVICE)
    q, k, v = _qkv(6, hq, hkv, d, gen)
    be = backend_cls(hq, hkv, d, d ** -0.5)
    cache = (k_cache.clone(), v_cache.clone())
    build_plan(be, md, DTYPE, DEVICE)
    out = be.forward(q, k, v, cache, md)
    assert md.prepared.num_splits == 4
    ref_cache = (k_cache.clone(), v_cache.clone())
    ref_be = TorchAttentionBackend(hq, hkv, d, d ** -0.5)
    build_plan(ref_be, md_ref, DTYPE, DEVICE)
    ref = ref_be.forward(q[:3], k[:3], v[:3], ref_cache, md_ref)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])
    torch.testing.assert_close(out[:3].float(), ref.float(), atol=ATOL, rtol=RTOL)
    assert out[3:].float().abs().sum().item() == 0.0
