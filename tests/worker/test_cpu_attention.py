"""The CPU attention backend (C kernel over the paged cache, csrc/attention.c, one row per query token)
against the torch reference backend, and how the kernel library is built, cached and refused. Its
end-to-end correctness (greedy equality with HF) is covered by test_model_equivalence.py and
test_gguf_smollm2.py, which run on it: "auto" picks it on CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from worker_testlib import build_plan, fused_qkv, paged_metadata

from cbserve.worker.attention import CpuAttentionBackend, TorchAttentionBackend, get_attention_backend
from cbserve.worker.attention.cpu_backend import row_args
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.native import KernelLoad, load_cpu_kernels

HAVE_CC = cpu_native._compiler() is not None
needs_kernels = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")


def _run_both(ctx_q: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int, seed: int,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One mixed batch through both backends; asserts they wrote the same cache, returns both outputs."""
    num_blocks = sum(-(-(c + q) // bs) for c, q in ctx_q) + 3
    md_c = paged_metadata(ctx_q, bs, num_blocks, torch.Generator().manual_seed(seed))
    md_t = paged_metadata(ctx_q, bs, num_blocks, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)  # cached prefixes
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    q, k, v = fused_qkv(int(md_c.query_start_loc[-1]), hq, hkv, d, gen, dtype)
    cache_c, cache_t = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    cpu_be, torch_be = CpuAttentionBackend(hq, hkv, d, d**-0.5), TorchAttentionBackend(hq, hkv, d, d**-0.5)
    build_plan(cpu_be, md_c, dtype)
    build_plan(torch_be, md_t, dtype)
    out_c = cpu_be.forward(q, k, v, cache_c, md_c)
    out_t = torch_be.forward(q, k, v, cache_t, md_t)
    assert torch.equal(cache_c[0], cache_t[0]) and torch.equal(cache_c[1], cache_t[1])
    return out_c, out_t


@needs_kernels
@pytest.mark.parametrize(
    "hq,hkv,d,bs",
    [(9, 3, 64, 16), (8, 8, 128, 32), (8, 1, 64, 1), (6, 2, 48, 16), (4, 2, 80, 8)],
    ids=["smollm2-gqa", "mha-128", "mqa-bs1", "generic-48", "generic-80"],
)
def test_matches_torch_backend_on_a_mixed_batch(hq: int, hkv: int, d: int, bs: int) -> None:
    # decodes of assorted lengths (a block boundary, a single token), then a fresh prompt, a prefix-cache hit
    # and a later chunk of a chunked prefill (those three as one kernel row per token, causal by context length)
    ctx_q = [(20, 1), (0, 1), (bs * 3 - 1, 1), (200, 1), (0, 25), (32, 9), (17, 40)]
    out_c, out_t = _run_both(ctx_q, hq, hkv, d, bs, seed=hq * 100 + d)
    torch.testing.assert_close(out_c, out_t, atol=2e-5, rtol=1e-5)


@needs_kernels
def test_long_prefill_contexts_go_to_sdpa_and_decodes_stay_on_the_kernel() -> None:
    """A chunk whose context exceeds ROWS_MAX_PREFILL_CONTEXT is attended by torch (faster there), the
    decodes of the same step by the kernel; such a step has no per-token rows, so the model's one-call
    layer driver leaves it to the modules."""
    from cbserve.worker.attention.cpu_backend import ROWS_MAX_PREFILL_CONTEXT
    from cbserve.worker.models.native_layers import rows_prepared

    ctx_q = [(40, 1), (300, 1), (ROWS_MAX_PREFILL_CONTEXT - 60, 100), (0, 12)]
    md = paged_metadata(ctx_q, 16, 80, torch.Generator().manual_seed(0))
    build_plan(CpuAttentionBackend(9, 3, 64, 0.125), md)
    assert md.prepared.prefill is not None and md.prepared.rows.seq_lens.tolist() == [41, 301]
    assert not rows_prepared(int(md.query_start_loc[-1]), md)
    out_c, out_t = _run_both(ctx_q, 9, 3, 64, 16, seed=5)
    torch.testing.assert_close(out_c, out_t, atol=2e-5, rtol=1e-5)


@needs_kernels
def test_short_queries_at_long_contexts_stay_kernel_rows() -> None:
    """A speculative verification (1 + 4 tokens) past ROWS_MAX_PREFILL_CONTEXT is still rows: the step keeps
    the one-call layer driver (the torch/module path cost 2x there); a long chunk there still goes to torch."""
    from cbserve.worker.attention.cpu_backend import ROWS_MAX_PREFILL_CONTEXT, ROWS_MAX_SHORT_QUERY
    from cbserve.worker.models.native_layers import rows_prepared

    ctx_q = [(40, 1), (ROWS_MAX_PREFILL_CONTEXT + 200, 5), (ROWS_MAX_PREFILL_CONTEXT, ROWS_MAX_SHORT_QUERY)]
    md = paged_metadata(ctx_q, 16, 140, torch.Generator().manual_seed(0))
    build_plan(CpuAttentionBackend(9, 3, 64, 0.125), md)
    assert md.prepared.prefill is None and md.prepared.rows.seq_lens.shape[0] == 1 + 5 + ROWS_MAX_SHORT_QUERY
    assert rows_prepared(int(md.query_start_loc[-1]), md)
    out_c, out_t = _run_both(ctx_q, 9, 3, 64, 16, seed=6)
    torch.testing.assert_close(out_c, out_t, atol=2e-5, rtol=1e-5)
    longer = paged_metadata([(40, 1), (ROWS_MAX_PREFILL_CONTEXT, ROWS_MAX_SHORT_QUERY + 1)], 16, 140,
                            torch.Generator().manual_seed(0))
    build_plan(CpuAttentionBackend(9, 3, 64, 0.125), longer)
    assert longer.prepared.prefill is not None


def test_row_args_give_every_token_its_context() -> None:
    # (cached context, query tokens): two decodes, then a fresh 3-token prompt and a 2-token chunk after 5
    md = paged_metadata([(6, 1), (0, 1), (0, 3), (5, 2)], 4, 20, torch.Generator().manual_seed(0))
    rows = row_args(md)
    assert rows.seq_lens.tolist() == [7, 1, 1, 2, 3, 6, 7]  # each token's position + 1: causal
    owner = [0, 1, 2, 2, 2, 3, 3]
    assert torch.equal(rows.block_tables, md.block_tables[owner].to(torch.int32))
    assert rows.block_tables.dtype == torch.int32 and rows.max_seq_len == 7
    decode_only = paged_metadata([(6, 1), (30, 1)], 4, 20, torch.Generator().manual_seed(0))
    assert row_args(decode_only).seq_lens.tolist() == [7, 31]


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [1, 3, 40])
def test_sequence_and_head_splitting_across_threads(num_seqs: int, threads: int) -> None:
    """Few sequences are split by kv head across threads; many are spread whole. Both give the reference."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ctx_q = [(37 * i % 300 + 1, 1) for i in range(num_seqs)]
        out_c, out_t = _run_both(ctx_q, 12, 4, 64, 16, seed=num_seqs)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out_c, out_t, atol=2e-5, rtol=1e-5)


@needs_kernels
def test_other_dtypes_fall_back_to_the_torch_path() -> None:
    out_c, out_t = _run_both([(40, 1), (9, 1), (0, 12)], 9, 3, 64, 16, seed=3, dtype=torch.bfloat16)
    assert out_c.dtype == torch.bfloat16
    assert torch.equal(out_c, out_t)


@needs_kernels
def test_kernel_refuses_bad_block_ids_and_inputs() -> None:
    kernels = load_cpu_kernels().kernels
    assert kernels is not None
    k_cache = torch.zeros(4, 16, 2, 64)
    q, out = torch.randn(1, 4, 64), torch.empty(1, 4, 64)
    seq_lens = torch.tensor([20], dtype=torch.int32)
    bad_table = torch.tensor([[1, 4]], dtype=torch.int32)  # block 4 of a 4-block cache
    with pytest.raises(RuntimeError, match="outside its table"):
        kernels.paged_decode(q, out, k_cache, k_cache, bad_table, seq_lens, 20, 0.125)
    good_table = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        kernels.paged_decode(q.double(), out.double(), k_cache, k_cache, good_table, seq_lens, 20, 0.125)
    with pytest.raises(ValueError, match="exceeds the block table"):
        kernels.paged_decode(q, out, k_cache, k_cache, good_table, seq_lens, 40, 0.125)
    with pytest.raises(ValueError, match="heads contiguous"):
        kernels.paged_decode(q.transpose(1, 2).contiguous().transpose(1, 2), out, k_cache, k_cache, good_table,
                             seq_lens, 20, 0.125)
    kernels.paged_decode(q, out, k_cache, k_cache, good_table, seq_lens, 20, 0.125)  # the good call works
    assert torch.equal(out, torch.zeros_like(out))  # zero values in, zeros out


@needs_kernels
def test_library_is_built_once_per_source_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_KERNEL_CACHE", str(tmp_path))
    first = cpu_native._build()
    assert first.kernels is not None, first.reason
    built = sorted(tmp_path.glob("cpu_kernels-*.so"))
    assert built == [first.kernels.path]
    stamp = built[0].stat().st_mtime_ns
    second = cpu_native._build()
    assert second.kernels is not None and second.kernels.path == first.kernels.path
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    assert not list(tmp_path.glob("*.so.*")) and len(list(tmp_path.iterdir())) == 1  # no temporary left over
    # another source (or compiler, flags, CPU) gets another file name
    src_dir = tmp_path / "csrc"
    shutil.copytree(cpu_native.SOURCE_DIR, src_dir)
    before = cpu_native._library_path(shutil.which("gcc") or "cc", ("-O3",))
    monkeypatch.setattr(cpu_native, "SOURCE_DIR", src_dir)
    assert cpu_native._library_path(shutil.which("gcc") or "cc", ("-O3",)) == before  # same bytes, same name
    (src_dir / "gemm.c").write_text((src_dir / "gemm.c").read_text() + "\n/* edited */\n")
    assert cpu_native._library_path(shutil.which("gcc") or "cc", ("-O3",)) != before
    assert cpu_native._library_path(shutil.which("gcc") or "cc", ("-O3",)) != cpu_native._library_path(
        shutil.which("gcc") or "cc", ("-O2",))


def test_unavailable_kernels_say_why_and_auto_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    failed = cpu_native._build()
    assert failed.kernels is None and "CPU kernels failed" in failed.reason
    assert not list(tmp_path.glob("*.so"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert "no C compiler" in cpu_native._build().reason
    monkeypatch.setenv("CBSERVE_CPU_KERNELS", "0")
    assert "disabled" in cpu_native._build().reason

    from cbserve.worker.attention import selector

    monkeypatch.setattr(selector, "load_cpu_kernels", lambda isa="auto": KernelLoad(None, "no compiler in this test"))
    assert get_attention_backend("auto", "cpu") is TorchAttentionBackend
    with pytest.raises(ValueError, match="no compiler in this test"):
        get_attention_backend("cpu", "cpu")


def test_cpu_backend_is_for_cpu_devices() -> None:
    with pytest.raises(ValueError, match="needs a CPU device"):
        get_attention_backend("cpu", "cuda")


@needs_kernels
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 2, 48)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 30.0)])
def test_rows_of_one_sequence_attended_together_equal_each_row_alone(
    kernels: object, hq: int, hkv: int, d: int, window: int | None, softcap: float | None
) -> None:
    """Consecutive rows of one sequence (context lengths +1 each, one block table: a prefill chunk, a
    speculative verification) are attended as one run of up to 8 rows; each row's output is bit for bit
    what it is attended alone, runs split mid-chunk included (13 rows), next to other sequences' rows."""
    bs, nblocks = 16, 40
    gen = torch.Generator().manual_seed(hq + d)
    k_cache, v_cache = torch.randn(nblocks, bs, hkv, d, generator=gen), torch.randn(nblocks, bs, hkv, d, generator=gen)
    table = torch.randperm(nblocks, generator=gen)[:12].to(torch.int32)
    other = torch.randperm(nblocks, generator=gen)[:12].to(torch.int32)
    lens = [40 + i for i in range(13)] + [7, 8] + [150 + i for i in range(5)]  # a chunk, another seq, a verification
    tables = torch.stack([table] * 13 + [other] * 2 + [table] * 5)
    q = torch.randn(len(lens), hq, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    together = torch.empty_like(q)
    kernels.paged_decode(q, together, k_cache, v_cache, tables, seq_lens, max(lens), d**-0.5, window, softcap)
    for i in range(len(lens)):
        alone = torch.empty_like(q[i : i + 1])
        kernels.paged_decode(q[i : i + 1].contiguous(), alone, k_cache, v_cache, tables[i : i + 1].contiguous(),
                             seq_lens[i : i + 1].contiguous(), lens[i], d**-0.5, window, softcap)
        assert torch.equal(together[i], alone[0]), i
