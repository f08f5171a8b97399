"""The FP8 KV cache (``kv_cache_dtype="fp8"``, attention/kv_fp8.py): the Triton kernels' write and attention against
the torch backend, their reference, and the cache against full-precision attention.

Without a CUDA GPU the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (conftest.py), at small sizes, in
float32; on a GPU the same tests run compiled in bfloat16. The FP8 kernels' sm_90 builds are checked in
``test_triton_compile.py``.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from worker_testlib import build_plan, fused_qkv, paged_metadata

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

from cbserve.worker.attention import TorchAttentionBackend  # noqa: E402
from cbserve.worker.attention.kv_fp8 import Fp8KVCache, allocate_fp8_cache, gather_fp8, write_fp8  # noqa: E402
from cbserve.worker.fp8 import FP8_DTYPE  # noqa: E402
from cbserve.worker.runner.kv_cache import allocate_kv_cache, bytes_per_block, copy_blocks  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
ATOL, RTOL = (2e-2, 2e-2) if CUDA else (2e-4, 2e-4)
pytestmark = pytest.mark.cuda  # the GPU suite (`pytest -m cuda`): compiled on CUDA, interpreted on CPU
HQ, HKV, D, BS = 4, 2, 32, 16
# decodes, then: a fresh prompt, a prefix-cache hit, a later chunk of a chunked prefill
CTX_Q = [(20, 1), (3, 1), (0, 9), (17, 6)]


@pytest.fixture(scope="module")
def tk(triton_kernels_module: ModuleType) -> ModuleType:
    return triton_kernels_module


def _filled_cache(num_blocks: int, gen: torch.Generator) -> Fp8KVCache:
    """An FP8 cache whose every slot holds quantized random K/V (the cached prefixes), with outliers up to 1000."""
    cache = allocate_fp8_cache(num_blocks, BS, HKV, D, torch.device(DEVICE))
    n = num_blocks * BS
    k = torch.randn(n, HKV, D, generator=gen) * torch.rand(n, HKV, 1, generator=gen) * 3
    k[::7, 0, 3] = 1000.0  # far beyond e4m3's 448: a scale per head vector takes it
    v = torch.randn(n, HKV, D, generator=gen) * 1e-3  # small values: subnormal with a unit scale
    write_fp8(k.to(DTYPE).to(DEVICE), v.to(DTYPE).to(DEVICE), cache, torch.arange(n, device=DEVICE))
    return cache


def _clone(cache: Fp8KVCache) -> Fp8KVCache:
    return Fp8KVCache(cache[0].clone(), cache[1].clone(), cache.k_scale.clone(), cache.v_scale.clone())


def _assert_same_cache(a: Fp8KVCache, b: Fp8KVCache) -> None:
    """Equal scales (float32 rounding) and e4m3 values (at most one e4m3 step apart where the compiled kernel's
    division rounds differently from torch's)."""
    torch.testing.assert_close(a.k_scale, b.k_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(a.v_scale, b.v_scale, rtol=1e-6, atol=0)
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        assert x.dtype == y.dtype == FP8_DTYPE
        torch.testing.assert_close(x.float(), y.float(), rtol=0.0625 if CUDA else 0, atol=0)


def test_write_kernel_quantizes_as_the_torch_reference(tk: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = _filled_cache(6, gen)
    out = allocate_fp8_cache(6, BS, HKV, D, torch.device(DEVICE))
    k = torch.randn(5, HKV, D, generator=gen) * 50
    v = torch.randn(5, HKV, D, generator=gen) * 1e-3
    k[1] = 0.0  # an all-zero token: the smallest scale, zeros back
    slots = torch.tensor([3, 17, 40, -1, 95], device=DEVICE)  # -1: a padded row, skipped
    out_k, out_v = out[0].view(torch.uint8), out[1].view(torch.uint8)
    ref_k, ref_v = ref[0].view(torch.uint8), ref[1].view(torch.uint8)
    out_k.copy_(ref_k), out_v.copy_(ref_v), out.k_scale.copy_(ref.k_scale), out.v_scale.copy_(ref.v_scale)
    kd, vd = k.to(DTYPE).to(DEVICE), v.to(DTYPE).to(DEVICE)
    tk.write_kv_cache(kd, vd, out[0], out[1], slots, (out.k_scale, out.v_scale))
    keep = slots >= 0
    write_fp8(kd[keep], vd[keep], ref, slots[keep])
    _assert_same_cache(out, ref)
    assert float(ref.k_scale.view(-1, HKV)[17].max()) == pytest.approx(1.0 / (448 * 512))
    deq_k, _ = gather_fp8(ref, torch.tensor([40 // BS], device=DEVICE), torch.float32)
    torch.testing.assert_close(deq_k[0, 40 % BS].cpu(), kd[2].float().cpu(), rtol=0.0625, atol=1e-2)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_triton_backend_on_an_fp8_cache_matches_the_torch_backend(
    triton_kernels_module: ModuleType, softcap: float | None
) -> None:
    """A mixed decode + prefill step on the Triton backend and on the torch backend, from the same FP8 cache: the
    same quantized writes, the same attention over the dequantized keys and values."""
    from cbserve.worker.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(1)
    num_blocks = sum(-(-(c + q) // BS) for c, q in CTX_Q) + 3
    md_t = paged_metadata(CTX_Q, BS, num_blocks, torch.Generator().manual_seed(2), DEVICE)
    md_r = paged_metadata(CTX_Q, BS, num_blocks, torch.Generator().manual_seed(2), DEVICE)
    cache_t = _filled_cache(num_blocks, gen)
    cache_r = _clone(cache_t)
    q, k, v = fused_qkv(int(md_t.query_start_loc[-1]), HQ, HKV, D, gen, DTYPE, DEVICE)
    triton_be = TritonAttentionBackend(HQ, HKV, D, D**-0.5, softcap=softcap)
    torch_be = TorchAttentionBackend(HQ, HKV, D, D**-0.5, softcap=softcap)
    build_plan(triton_be, md_t, DTYPE, DEVICE)
    build_plan(torch_be, md_r, DTYPE, DEVICE)
    out_t = triton_be.forward(q, k, v, cache_t, md_t)
    out_r = torch_be.forward(q, k, v, cache_r, md_r)
    _assert_same_cache(cache_t, cache_r)
    torch.testing.assert_close(out_t.float(), out_r.float(), atol=ATOL, rtol=RTOL)


def test_fp8_cache_is_close_to_full_precision_and_differs() -> None:
    """The torch backend over an FP8 cache against the same step over a cache in the model's dtype: within e4m3's
    rounding (a few percent of the output's scale), and not equal (the keys and values were quantized)."""
    gen = torch.Generator().manual_seed(3)
    num_blocks = sum(-(-(c + q) // BS) for c, q in CTX_Q) + 2
    md8 = paged_metadata(CTX_Q, BS, num_blocks, torch.Generator().manual_seed(4), DEVICE)
    md = paged_metadata(CTX_Q, BS, num_blocks, torch.Generator().manual_seed(4), DEVICE)
    cache8 = allocate_fp8_cache(num_blocks, BS, HKV, D, torch.device(DEVICE))
    full = allocate_kv_cache(1, num_blocks, BS, HKV, D, DTYPE, torch.device(DEVICE))[0]
    n = num_blocks * BS
    ctx_k, ctx_v = (torch.randn(n, HKV, D, generator=gen).to(DTYPE).to(DEVICE) for _ in range(2))
    write_fp8(ctx_k, ctx_v, cache8, torch.arange(n, device=DEVICE))
    full[0].view(n, HKV, D).copy_(ctx_k), full[1].view(n, HKV, D).copy_(ctx_v)
    q, k, v = fused_qkv(int(md.query_start_loc[-1]), HQ, HKV, D, gen, DTYPE, DEVICE)
    be8, be = TorchAttentionBackend(HQ, HKV, D, D**-0.5), TorchAttentionBackend(HQ, HKV, D, D**-0.5)
    build_plan(be8, md8, DTYPE, DEVICE)
    build_plan(be, md, DTYPE, DEVICE)
    out8, out = be8.forward(q, k, v, cache8, md8).float(), be.forward(q, k, v, full, md).float()
    err = (out8 - out).abs().max().item()
    assert 0 < err < 0.05 * out.abs().max().item()


def test_kernels_refuse_an_fp8_cache_without_its_scales(tk: ModuleType) -> None:
    cache = allocate_fp8_cache(2, BS, HKV, D, torch.device(DEVICE))
    q = torch.zeros(1, HQ, D, dtype=DTYPE, device=DEVICE)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="takes its kv_scales"):
        tk.decode_attention(q, cache[0], cache[1], bt, lens, 1)
    with pytest.raises(ValueError, match="kv_scales must be float32"):
        tk.decode_attention(q, cache[0], cache[1], bt, lens, 1, kv_scales=(cache.k_scale[:1], cache.v_scale[:1]))
    plain = torch.zeros(2, BS, HKV, D, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="takes no kv_scales"):
        tk.decode_attention(q, plain, plain, bt, lens, 1, kv_scales=(cache.k_scale, cache.v_scale))


def test_block_copies_and_sizes_of_an_fp8_cache() -> None:
    caches = allocate_kv_cache(2, 4, BS, HKV, D, DTYPE, torch.device(DEVICE), kv_fp8=True)
    assert all(isinstance(c, Fp8KVCache) and c[0].dtype == FP8_DTYPE for c in caches)
    gen = torch.Generator().manual_seed(5)
    write_fp8(
        *(torch.randn(BS, HKV, D, generator=gen).to(DEVICE) for _ in range(2)),
        caches[1],
        torch.arange(BS, 2 * BS, device=DEVICE),
    )
    copy_blocks(caches, [(1, 3)])
    c = caches[1]
    assert torch.equal(c[0][3].view(torch.uint8), c[0][1].view(torch.uint8)) and torch.equal(c.v_scale[3], c.v_scale[1])
    assert not torch.equal(c.k_scale[3], c.k_scale[0])
    # e4m3 bytes plus a float32 scale per token and head, against the model dtype's elements
    assert bytes_per_block(2, BS, HKV, D, DTYPE, kv_fp8=True) == 2 * 2 * BS * HKV * (D + 4)
    assert bytes_per_block(2, BS, HKV, D, torch.float32) == 2 * 2 * BS * HKV * D * 4
