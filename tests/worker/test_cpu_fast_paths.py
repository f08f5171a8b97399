"""CPU fast paths: packed linear weights (oneDNN here; the C kernels' own tests are in test_cpu_kernels.py),
the reused gather buffer of the torch attention backend, and the malloc settings. Their end-to-end
correctness (greedy equality with HF) is covered by test_model_equivalence.py and test_gguf_smollm2.py,
which run with the default cpu_ops="auto" (native C kernels where a compiler is found)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from worker_testlib import make_tiny_model

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.attention.torch_backend import _GatherBuffer
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.linear import onednn_bf16_supported, pack_weight, packed_linear, packing_supported
from cbserve.worker.cpu.malloc import tune_malloc_for_cpu_inference
from cbserve.worker.layers.basic import ColumnParallelLinear, RowParallelLinear
from cbserve.worker.runner.input_batch import CachedRequestState, build_batch
from cbserve.worker.runner.model_runner import ModelRunner

needs_onednn = pytest.mark.skipif(
    not packing_supported(torch.empty(2, 2)), reason="torch was built without oneDNN"
)
needs_cc = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tied"), "llama3_tied")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 11, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear(rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 80, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 80, dtype=dtype)
    if dtype == torch.bfloat16 and not onednn_bf16_supported():  # e.g. an AVX2-only CPU: refused, not crashed
        assert packing_supported(w) is False
        with pytest.raises(ValueError, match="cannot pack"):
            pack_weight(w)
        return
    packed = pack_weight(w)
    assert packed.is_mkldnn
    tol = 1e-4 if dtype == torch.float32 else 0.25
    torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), atol=tol, rtol=tol / 10)


def test_pack_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="cannot pack"):
        pack_weight(torch.zeros(4, 4, dtype=torch.float16))
    layer = ColumnParallelLinear(8, [4], bias=False)
    layer.weight.data = layer.weight.data.half()
    assert layer.pack(release_dense=True) is False
    assert layer.packed is None and layer.weight.numel() == 32  # unchanged, still usable


@needs_onednn
def test_packing_releases_the_dense_weight_and_keeps_the_result() -> None:
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(16, [8, 8], bias=True), RowParallelLinear(16, 12, bias=True)
    for layer in (col, row):
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(5, 16)
    before = [col(x), row(x)]
    assert col.pack(release_dense=True) and row.pack(release_dense=True)
    assert col.weight.numel() == 0 and row.weight.numel() == 0
    torch.testing.assert_close(col(x), before[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(row(x), before[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="packed weight needs"):
        col(x.double())


@needs_onednn
@pytest.mark.parametrize("cpu_ops", ["onednn", pytest.param("native", marks=needs_cc)])
def test_runner_packs_linears_but_keeps_the_tied_embedding(tied_folder: Path, cpu_ops: str) -> None:
    packed = ModelRunner(ModelConfig(model=str(tied_folder), cpu_ops=cpu_ops, device="cpu", block_size=4),
                         progress=False)
    plain = ModelRunner(ModelConfig(model=str(tied_folder), cpu_ops="torch", device="cpu", block_size=4),
                        progress=False)
    assert (packed.cpu_ops, plain.cpu_ops) == (cpu_ops, "torch")
    m = packed.model
    assert m.tie_word_embeddings
    assert m.lm_head.packed is not None
    assert m.model.embed_tokens.weight.shape == (320, 64)  # shared with the LM head: not released
    layer = m.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.self_attn.qkv_proj.weight.numel() == 0
    assert layer.mlp.down_proj.packed is not None
    assert plain.model.model.layers[0].mlp.down_proj.packed is None
    # Same logits either way (one decode step over a 3-request batch of different lengths).
    outs = []
    for r in (packed, plain):
        r.init_kv_cache(32)
        states = [
            CachedRequestState(f"r{i}", list(range(5, 5 + n)), n, SamplingParams(), list(range(4 * i, 4 * i + 4)), 0)
            for i, n in enumerate((3, 9, 14))
        ]
        batch = build_batch(states, {s.req_id: len(s.token_ids) for s in states}, 4, torch.device("cpu"))
        with torch.inference_mode():
            outs.append(r.forward_logits(batch, r.kv_caches))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_gather_buffer_is_reused_and_exact() -> None:
    torch.manual_seed(0)
    kv = (torch.randn(10, 4, 2, 8), torch.randn(10, 4, 2, 8))
    buf = _GatherBuffer()
    blocks = torch.tensor([7, 2, 9, 2, 0], dtype=torch.long)
    k, v = buf.gather(kv, blocks)
    assert torch.equal(k, kv[0][blocks]) and torch.equal(v, kv[1][blocks])
    ptr = k.data_ptr()
    k2, v2 = buf.gather(kv, blocks[:3])  # smaller: same storage
    assert k2.data_ptr() == ptr and torch.equal(v2, kv[1][blocks[:3]])
    k3, _ = buf.gather(kv, torch.arange(8))  # larger: grown
    assert k3.shape[0] == 8 and torch.equal(k3, kv[0][:8])
    other = (kv[0].double(), kv[1].double())  # another dtype: a new buffer, not a wrong-typed copy
    k4, _ = buf.gather(other, blocks)
    assert k4.dtype == torch.float64 and torch.equal(k4, other[0][blocks])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_malloc_tuning_is_accepted_by_glibc() -> None:
    assert tune_malloc_for_cpu_inference() is True
