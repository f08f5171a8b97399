"""Sliding-window attention and logit soft-capping in every attention backend against one readable reference:
the torch backend, the CPU backend (C kernel rows, and torch's SDPA for long prefill contexts) and the Triton
kernels (interpreted without CUDA), on mixed batches of decodes, fresh prompts, prefix-cache hits and later
chunks, with windows shorter than, equal to and longer than the contexts."""

from __future__ import annotations

import pytest
import torch
from worker_testlib import build_plan, fused_qkv, paged_metadata

from cbserve.worker.attention import CpuAttentionBackend, TorchAttentionBackend
from cbserve.worker.cpu import native as cpu_native

needs_kernels = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")
# (cached context, query tokens): decodes (one at a block boundary, one of a single token), a fresh prompt,
# a prefix-cache hit and a later chunk of a chunked prefill
MIX = [(20, 1), (0, 1), (47, 1), (120, 1), (0, 25), (32, 9), (17, 40)]
CASES = [(None, None), (5, None), (1, None), (16, 2.0), (None, 2.0), (500, None)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
    """q [m, Hq, D] at positions q_pos over keys/values [n, Hkv, D] at 0..n-1."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    kpos = torch.arange(k.shape[0])[None, :]
    keep = kpos <= q_pos[:, None]
    if window is not None:
        keep &= kpos > q_pos[:, None] - window
    s = s.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), v).float()


def _batch(ctx_q: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int, seed: int):
    num_blocks = sum(-(-(c + q) // bs) for c, q in ctx_q) + 3
    md = paged_metadata(ctx_q, bs, num_blocks, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    cache = (torch.randn(num_blocks, bs, hkv, d, generator=gen), torch.randn(num_blocks, bs, hkv, d, generator=gen))
    q, k, v = fused_qkv(int(md.query_start_loc[-1]), hq, hkv, d, gen)
    return md, cache, q, k, v


def _expected(md, cache, q, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """The reference over the cache (this step's k/v already written), request by request."""
    out = torch.empty_like(q)
    bs = md.block_size
    for r in range(md.num_reqs):
        lo, hi, n = int(md.query_start_loc[r]), int(md.query_start_loc[r + 1]), md.seq_lens_cpu[r]
        pos = torch.arange(n)
        blocks = md.block_tables[r, pos // bs].long()
        k, v = cache[0][blocks, pos % bs], cache[1][blocks, pos % bs]
        out[lo:hi] = _reference(q[lo:hi], k, v, torch.arange(n - (hi - lo), n), scale, window, softcap)
    return out


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernels)])
@pytest.mark.parametrize("hq,hkv,d,bs", [(6, 2, 64, 16), (4, 4, 128, 4), (4, 2, 16, 8)],
                         ids=["gqa-64", "mha-128", "generic-16"])
def test_backend_window_and_softcap(backend: str, window: int | None, softcap: float | None, hq: int, hkv: int,
                                    d: int, bs: int) -> None:
    md, cache, q, k, v = _batch(MIX, hq, hkv, d, bs, seed=hq + d + (window or 0))
    cls = CpuAttentionBackend if backend == "cpu" else TorchAttentionBackend
    be = cls(hq, hkv, d, 0.3, window, softcap)
    build_plan(be, md)
    out = be.forward(q, k, v, cache, md)
    torch.testing.assert_close(out, _expected(md, cache, q, 0.3, window, softcap), atol=2e-5, rtol=1e-5)


@needs_kernels
def test_cpu_long_prefill_context_takes_the_window_to_sdpa() -> None:
    """A prefill context too long for kernel rows is attended by torch: with the same window and cap."""
    from cbserve.worker.attention.cpu_backend import ROWS_MAX_PREFILL_CONTEXT

    md, cache, q, k, v = _batch([(40, 1), (ROWS_MAX_PREFILL_CONTEXT, 30)], 4, 2, 64, 16, seed=9)
    be = CpuAttentionBackend(4, 2, 64, 0.125, 24, 3.0)
    build_plan(be, md)
    assert md.prepared.prefill is not None
    out = be.forward(q, k, v, cache, md)
    torch.testing.assert_close(out, _expected(md, cache, q, 0.125, 24, 3.0), atol=2e-5, rtol=1e-5)


def test_a_window_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        TorchAttentionBackend(4, 2, 16, 0.25, 0)
    with pytest.raises(ValueError, match="softcap"):
        TorchAttentionBackend(4, 2, 16, 0.25, None, -1.0)


# ---- Triton (interpreted without CUDA) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tk(triton_kernels_module):  # noqa: ANN001, ANN201
    return triton_kernels_module


@pytest.mark.cuda  # the GPU suite (`pytest -m cuda`): compiled on CUDA, interpreted on CPU
@pytest.mark.parametrize("window,softcap", [(5, None), (16, 2.0), (None, 2.0), (1, None)])
def test_triton_prefill_and_decode_window_and_softcap(tk, window: int | None, softcap: float | None) -> None:  # noqa: ANN001
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    md, cache, q, k, v = _batch(MIX, 6, 2, 64, 16, seed=31 + (window or 0))
    k_cache, v_cache = (c.to(dev) for c in cache)  # written by the kernel on the kernel's device
    tk.write_kv_cache(k.contiguous().to(dev), v.contiguous().to(dev), k_cache, v_cache, md.slot_mapping.to(dev))
    expected = _expected(md, (k_cache.cpu(), v_cache.cpu()), q, 0.3, window, softcap)
    nd, qc = md.num_decodes, q.contiguous()
    to = [t.to(dev) for t in (qc, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc)]
    for splits in (1, 3):  # 3: a window shorter than a split leaves some splits empty
        dec = tk.decode_attention(to[0][:nd], to[1], to[2], to[3][:nd], to[4][:nd], splits, 0.3, window=window,
                                  softcap=softcap)
        torch.testing.assert_close(dec.float().cpu(), expected[:nd], atol=2e-4, rtol=2e-4)
    pre = tk.prefill_attention(to[0], to[1], to[2], to[3][nd:], to[5][nd:], to[4][nd:], max(md.query_lens_cpu[nd:]),
                               0.3, window=window, softcap=softcap)
    torch.testing.assert_close(pre[nd:].float().cpu(), expected[nd:], atol=2e-4, rtol=2e-4)
