"""Triton paged-attention kernels against readable torch references.

Without a CUDA GPU the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` at small sizes (fp32); on a
GPU the same tests run natively at larger sizes in bf16. Skips cleanly when triton is not installed.
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
pytestmark = pytest.mark.cuda  # the GPU suite (`pytest -m cuda`): compiled on CUDA, interpreted on CPU
DTYPE = torch.bfloat16 if CUDA else torch.float32
ATOL, RTOL = (2e-2, 2e-2) if CUDA else (2e-4, 2e-4)
SCALE = 4 if CUDA else 1  # sequence length multiplier on a real GPU

# (num_q_heads, num_kv_heads): GQA ratios 1, 3 and 8.
HEADS = [(2, 2), (6, 2), (8, 1)]
HEAD_DIMS = [64, 128]
BLOCK_SIZES = [1, 16, 32]


@pytest.fixture(scope="module")
def tk(triton_kernels_module):
    """The kernels module (interpreted without CUDA)."""
    return triton_kernels_module


# ------------------------------------------------------------------------------------------- references


def _paged_setup(ctx_q: list[tuple[int, int]], num_kv_heads: int, head_dim: int, block_size: int,
                 gen: torch.Generator):
    """Random caches holding K/V for every position of every request, behind shuffled block tables."""
    seq_lens = [c + q for c, q in ctx_q]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(ctx_q), max_blocks, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        block_tables[r, :nb] = torch.tensor(perm[used:used + nb], dtype=torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(DTYPE)
    v_cache = torch.randn(shape, generator=gen).to(DTYPE)
    return k_cache, v_cache, block_tables, seq_lens


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """Keys/values 0..n-1 of one request: [n, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    pos = torch.arange(n)
    return cache[table[pos // block_size].long(), pos % block_size].float()


def _ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [m, Hq, D] at positions q_pos attends causally to k/v [n, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), v)


def _to(x: torch.Tensor) -> torch.Tensor:
    return x.to(DEVICE)


# ---------------------------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (3, 64)])
def test_write_kv_cache(tk, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 7 + num_kv_heads)
    num_tokens = 9 * SCALE
    num_blocks = max(12, -(-num_tokens // block_size) + 2)  # a slot for every token (36 on a GPU: 1-token blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=DTYPE)
    v_cache = torch.zeros(shape, dtype=DTYPE)
    total = num_blocks * block_size
    slots = torch.randperm(total, generator=gen)[:num_tokens]
    slots[::4] = -1  # padded rows are skipped
    # K/V as views into a fused qkv buffer: non-contiguous token stride.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(DTYPE)
    key, value = qkv[:, 1], qkv[:, 2]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            ref_k[slot // block_size, slot % block_size] = key[t]
            ref_v[slot // block_size, slot % block_size] = value[t]
    k_dev, v_dev = _to(k_cache), _to(v_cache)
    qkv_dev = _to(qkv)
    tk.write_kv_cache(qkv_dev[:, 1], qkv_dev[:, 2], k_dev, v_dev, _to(slots))
    assert torch.equal(k_dev.cpu(), ref_k)
    assert torch.equal(v_dev.cpu(), ref_v)


def test_write_kv_cache_int32_slots_and_empty(tk) -> None:
    k_cache = torch.zeros(4, 16, 2, 64, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, 64, dtype=DTYPE, device=DEVICE)
    tk.write_kv_cache(key, key * 2, k_cache, v_cache, torch.tensor([17, -1, 63], dtype=torch.int32,
                                                                      device=DEVICE))
    assert k_cache[1, 1].eq(1).all() and v_cache[3, 15].eq(2).all()
    assert k_cache.sum().item() == 2 * 2 * 64
    tk.write_kv_cache(key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))


# ----------------------------------------------------------------------------------------------- prefill

# (cached context, new tokens) per request: fresh prompts, prefix-cache hits, chunked-prefill chunks,
# decode rows mixed in, block-boundary edge cases.
PREFILL_MIX = [(0, 37), (16, 21), (0, 1), (45, 3), (31, 33), (64, 16), (5, 1)]


def _run_prefill(tk, ctx_q, num_q_heads, num_kv_heads, head_dim, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = _paged_setup(ctx_q, num_kv_heads, head_dim, block_size, gen)
    q_lens = [q for _, q in ctx_q]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(DTYPE)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    out = tk.prefill_attention(_to(q), _to(k_cache), _to(v_cache), _to(block_tables), _to(cu),
                               _to(torch.tensor(seq_lens, dtype=torch.int32)), max(q_lens), scale)
    for r, (ctx, ql) in enumerate(ctx_q):
        rows = slice(int(cu[r]), int(cu[r + 1]))
        k = _gather(k_cache, block_tables[r], seq_lens[r])
        v = _gather(v_cache, block_tables[r], seq_lens[r])
        ref = _ref_attention(q[rows], k, v, torch.arange(ctx, ctx + ql), scale)
        torch.testing.assert_close(out[rows].float().cpu(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_prefill_attention(tk, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    ctx_q = [(c * SCALE, q * SCALE) for c, q in PREFILL_MIX]
    _run_prefill(tk, ctx_q, num_q_heads, num_kv_heads, head_dim, block_size, seed=head_dim + block_size)


def test_chunked_prefill_matches_whole_prompt(tk) -> None:
    """A prompt prefilled in chunks (each chunk attending to the earlier ones in the cache) gives the
    rows a single whole-prompt pass gives."""
    gen = torch.Generator().manual_seed(3)
    n, hq, hkv, d, bs = 50 * SCALE, 4, 2, 64, 16
    k_cache, v_cache, bt, _ = _paged_setup([(0, n)], hkv, d, bs, gen)
    q = torch.randn(n, hq, d, generator=gen).to(DTYPE)
    dev = [_to(x) for x in (k_cache, v_cache, bt)]
    whole = tk.prefill_attention(_to(q), *dev, _to(torch.tensor([0, n], dtype=torch.int32)),
                                 _to(torch.tensor([n], dtype=torch.int32)), n)
    start = 0
    for chunk in (7 * SCALE, 20 * SCALE, n - 27 * SCALE):
        end = start + chunk
        part = tk.prefill_attention(_to(q[start:end]), *dev, _to(torch.tensor([0, chunk], dtype=torch.int32)),
                                    _to(torch.tensor([end], dtype=torch.int32)), chunk)
        torch.testing.assert_close(part.float(), whole[start:end].float(), atol=ATOL, rtol=RTOL)
        start = end


def test_prefill_rejects_bad_heads(tk) -> None:
    k = torch.zeros(2, 16, 3, 64, dtype=DTYPE, device=DEVICE)
    q = torch.zeros(4, 4, 64, dtype=DTYPE, device=DEVICE)
    i32 = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        tk.prefill_attention(q, k, k, i32[None], i32, i32[:1], 4)


# ------------------------------------------------------------------------------------------------ decode

DECODE_LENS = [1, 17, 64, 5, 100, 33]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_decode_attention(tk, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(head_dim * 3 + block_size + num_q_heads)
    lens = [n * SCALE for n in DECODE_LENS]
    ctx_q = [(n - 1, 1) for n in lens]
    k_cache, v_cache, bt, seq_lens = _paged_setup(ctx_q, num_kv_heads, head_dim, block_size, gen)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(DTYPE)
    refs = [
        _ref_attention(q[r:r + 1], _gather(k_cache, bt[r], n), _gather(v_cache, bt[r], n),
                       torch.tensor([n - 1]), head_dim ** -0.5)[0]
        for r, n in enumerate(seq_lens)
    ]
    sl = _to(torch.tensor(seq_lens, dtype=torch.int32))
    for num_splits in (1, 3):  # 3: uneven splits, some empty for short sequences
        out = tk.decode_attention(_to(q), _to(k_cache), _to(v_cache), _to(bt), sl, num_splits)
        torch.testing.assert_close(out.float().cpu(), torch.stack(refs), atol=ATOL, rtol=RTOL)


def test_decode_padded_rows_are_zero_and_match_prefill(tk) -> None:
    """seq_len 0 (CUDA-graph padding) yields zeros; real rows agree with the varlen kernel."""
    gen = torch.Generator().manual_seed(11)
    ctx_q = [(40, 1), (9, 1), (0, 1)]
    k_cache, v_cache, bt, seq_lens = _paged_setup(ctx_q, 2, 64, 16, gen)
    seq_lens[2] = 0  # padded slot
    q = torch.randn(3, 8, 64, generator=gen).to(DTYPE)
    dev = [_to(x) for x in (q, k_cache, v_cache, bt)]
    sl = _to(torch.tensor(seq_lens, dtype=torch.int32))
    out = tk.decode_attention(*dev, sl, num_splits=4)
    assert out[2].float().abs().sum().item() == 0.0
    cu = _to(torch.tensor([0, 1, 2], dtype=torch.int32))
    ref = tk.prefill_attention(dev[0][:2], *dev[1:], cu, sl[:2], 1)
    torch.testing.assert_close(out[:2].float(), ref.float(), atol=ATOL, rtol=RTOL)


def test_default_num_splits(tk) -> None:
    assert tk.default_num_splits(1, 8, 100) == 1
    assert tk.default_num_splits(1, 8, 32768) == 16
    assert tk.default_num_splits(256, 8, 32768) == 1
    assert 1 <= tk.default_num_splits(4, 8, 4096) <= 16


def test_default_num_splits_stays_in_buckets(tk) -> None:
    """NUM_SPLITS is a compile-time constant: every choice must be one of the few SPLIT_BUCKETS."""
    assert tk.SPLIT_BUCKETS == (1, 2, 4, 8, 16)
    seen = set()
    for num_reqs in (1, 2, 3, 5, 7, 16, 33, 100, 256, 1024):
        for num_kv_heads in (1, 2, 3, 4, 8, 16):
            for max_len in (0, 1, 100, 257, 700, 1500, 3000, 5000, 10000, 32768, 131072):
                for sms in (1, 20, 78, 108, 114, 132, 144):
                    seen.add(tk.default_num_splits(num_reqs, num_kv_heads, max_len, sms))
    assert seen == set(tk.SPLIT_BUCKETS)  # every bucket is reachable and nothing else is returned
    assert tk.default_num_splits(1, 8, 32768, max_splits=12) == 8  # rounded down, never above max_splits


def test_cuda_tiles_by_head_dim(tk) -> None:
    """head_dim 256 takes smaller tiles than the 64 x 64 used up to 128."""
    assert tk.cuda_tiles(64) == tk.cuda_tiles(128)
    small, large = tk.cuda_tiles(128), tk.cuda_tiles(256)
    assert (small.prefill_block_m, small.prefill_block_n, small.decode_block_n) == (64, 64, 64)
    assert large.prefill_block_m * large.prefill_block_n < small.prefill_block_m * small.prefill_block_n
    assert large.decode_block_n < small.decode_block_n
    assert large.prefill_warps == 8
