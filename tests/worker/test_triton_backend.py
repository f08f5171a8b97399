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

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
ATOL, RTOL = (2e-2, 2e-2) if CUDA else (2e-4, 2e-4)


@pytest.fixture(scope="module")
def backend_cls(triton_kernels_module):
    from cbserve.worker.attention import triton_backend

    return triton_backend.TritonAttentionBackend


def _metadata(ctx_q: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator,
              pad_decodes: int = 0):
    """Decode-first batch: requests with q_len 1 must come first. ``pad_decodes`` appends CUDA-graph style
    padded decode rows (slot -1, seq_len 0) after the real decodes (only valid for decode-only batches)."""
    from cbserve.worker.attention import AttentionMetadata

    seq_lens = [c + q for c, q in ctx_q]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, used = [], [], 0
    for (ctx, _ql), sl in zip(ctx_q, seq_lens, strict=True):
        nb = -(-sl // block_size)
        blocks = perm[used:used + nb]
        used += nb
        tables.append(blocks + [0] * (max_blocks - nb))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx, sl)]
    q_lens = [q for _, q in ctx_q] + [1] * pad_decodes
    seq_lens += [0] * pad_decodes
    tables += [[0] * max_blocks] * pad_decodes
    slots += [-1] * pad_decodes
    num_decodes = sum(1 for q in q_lens if q == 1)
    if q_lens[:num_decodes] != [1] * num_decodes:
        raise ValueError("test batches must be decode-first")
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=torch.tensor(tables, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        query_start_loc=torch.tensor([0] + q_lens, **i32).cumsum(0).to(torch.int32),
        num_decodes=num_decodes,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )


def _qkv(num_tokens: int, hq: int, hkv: int, d: int, gen: torch.Generator):
    """q/k/v as views into one fused projection output, like the model produces."""
    fused = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(DTYPE).to(DEVICE)
    q, k, v = fused.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d), v.reshape(num_tokens, hkv, d)


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
    triton_be.prepare(md_t)
    out_t = triton_be.forward(q, k, v, cache_t, md_t)
    out_r = torch_be.forward(q, k, v, cache_r, md_r)
    assert torch.equal(cache_t[0], cache_r[0]) and torch.equal(cache_t[1], cache_r[1])
    torch.testing.assert_close(out_t.float(), out_r.float(), atol=ATOL, rtol=RTOL)


def test_padded_decode_rows_and_fixed_splits(backend_cls) -> None:
    """CUDA-graph style batch: padded rows (slot -1, seq_len 0) leave the cache alone and give zeros; a
    preset split count (as a graph runner sets it) is respected."""
    from cbserve.worker.attention import TorchAttentionBackend
    from cbserve.worker.attention.triton_backend import NUM_SPLITS_KEY

    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 64, 16
    ctx_q = [(30, 1), (0, 1), (47, 1)]
    md = _metadata(ctx_q, bs, 12, gen, pad_decodes=3)
    md.extras[NUM_SPLITS_KEY] = 4
    md_ref = _metadata(ctx_q, bs, 12, torch.Generator().manual_seed(5))
    k_cache = torch.randn(12, bs, hkv, d, generator=gen).to(DTYPE).to(DEVICE)
    v_cache = torch.randn(12, bs, hkv, d, generator=gen).to(DTYPE).to(DEVICE)
    q, k, v = _qkv(6, hq, hkv, d, gen)
    be = backend_cls(hq, hkv, d, d ** -0.5)
    cache = (k_cache.clone(), v_cache.clone())
    out = be.forward(q, k, v, cache, md)
    assert md.extras[NUM_SPLITS_KEY] == 4
    ref_cache = (k_cache.clone(), v_cache.clone())
    ref = TorchAttentionBackend(hq, hkv, d, d ** -0.5).forward(q[:3], k[:3], v[:3], ref_cache, md_ref)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])
    torch.testing.assert_close(out[:3].float(), ref.float(), atol=ATOL, rtol=RTOL)
    assert out[3:].float().abs().sum().item() == 0.0
