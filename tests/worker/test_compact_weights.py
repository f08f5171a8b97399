"""Compact CPU weights: GGUF Q8_0 / Q4_0 / Q4_1 blocks and bfloat16 values packed for the linear kernel,
decoding to exactly the float32 weights they stand for, and giving the same products as float32 panels.
The whole-model greedy equality with HF on them is in test_gguf_smollm2.py (the bundled Q4_1/Q8_0 GGUF)
and test_model_equivalence.py (variant llama_bf16_values)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_writer import quantize
from worker_testlib import make_tiny_model

from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.gguf_blocks import (
    BLOCKS_FILE,
    QuantBlocks,
    extract_gguf_blocks,
    load_gguf_blocks,
    save_gguf_blocks,
)
from cbserve.worker.cpu.kernels import CpuKernels, is_bfloat16_exact
from cbserve.worker.cpu.linear import NativeWeight, make_packed_weight, native_weight
from cbserve.worker.loading.model_info import default_model_path
from cbserve.worker.loading.model_loader import iter_weights, resolve_model
from cbserve.worker.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")


def gguf_blocks(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QuantBlocks, torch.Tensor]:
    """A random [n, k] weight quantized by gguf-py (the K-quants by gguf_writer's quantizers), and gguf-py's own
    float32 dequantization of it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = np.random.default_rng(seed).normal(0.0, 0.05, size=(n, k)).astype(np.float32)
    raw = quantize(w, qtype)
    return QuantBlocks(qtype, torch.from_numpy(raw)), torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))


def pack_blocks(kernels: CpuKernels, blocks: QuantBlocks):  # noqa: ANN201
    return kernels.pack_blocks(blocks)


# bytes per weight of each format's panels: GGUF's own (Q4_K's 6-bit sub-scales take a byte each here)
PER_WEIGHT = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q5_0": 22 / 32, "Q4_K": 148 / 256,
              "Q5_K": 180 / 256, "Q6_K": 210 / 256}


@pytest.mark.parametrize("qtype", list(PER_WEIGHT))
@pytest.mark.parametrize("n,blocks_k", [(48, 1), (100, 3), (7, 5)])
def test_gguf_blocks_decode_to_gguf_py_values_bit_for_bit(kernels: CpuKernels, qtype: str, n: int,
                                                          blocks_k: int) -> None:
    k = blocks_k * (256 if qtype.endswith("_K") else 32)
    blocks, reference = gguf_blocks(qtype, n, k)
    assert blocks.shape == (n, k)
    packed = pack_blocks(kernels, blocks)
    assert packed.fmt == qtype.lower()
    decoded = kernels.unpack(packed)
    assert torch.equal(decoded, reference)
    if qtype not in ("Q4_0", "Q5_0", "Q6_K"):  # d * (q - 8) (q - 16, q - 32) is -0 in gguf-py for q = 8, d < 0; +0 here
        assert torch.equal(decoded.view(torch.int32), reference.view(torch.int32))
    per_weight = packed.nbytes / (-(-n // 48) * 48 * k)
    assert per_weight == PER_WEIGHT[qtype]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 5, 11, 100, 200])
def test_compact_products_equal_float32_panels_exactly(kernels: CpuKernels, qtype: str, m: int) -> None:
    """Same values, same k order: the format changes the bytes read, not one bit of the result. k = 320 (768
    for the K-quants) crosses the kernel's k chunks (64 wide for up to 32 rows, 256 for more); m = 200 crosses
    its 192-row blocks; n = 100 ends in a partial panel; the bias is added first, as in the float32 path."""
    k = 768 if qtype.endswith("_K") else 320
    blocks, w = gguf_blocks(qtype, 100, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(100, generator=gen)
    dense = kernels.pack_weight(w)
    compact = pack_blocks(kernels, blocks)
    assert torch.equal(kernels.linear(x, compact, bias), kernels.linear(x, dense, bias))
    assert torch.equal(kernels.linear(x, compact, None), kernels.linear(x, dense, None))
    torch.testing.assert_close(kernels.linear(x, compact, bias), x @ w.t() + bias, atol=1e-4, rtol=1e-5)


def test_bf16_panels(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(130, 70, generator=gen).bfloat16().float()
    assert is_bfloat16_exact(w) and not is_bfloat16_exact(w + 1e-3)
    packed = kernels.pack_weight(w, "bf16")
    assert packed.nbytes == 3 * 48 * 70 * 2 and torch.equal(kernels.unpack(packed), w)
    x = torch.randn(9, 70, generator=gen)
    assert torch.equal(kernels.linear(x, packed, None), kernels.linear(x, kernels.pack_weight(w), None))
    with pytest.raises(ValueError, match="not bfloat16"):
        kernels.pack_weight(w + 1e-3, "bf16")


def test_packing_refuses_bad_blocks(kernels: CpuKernels) -> None:
    d = torch.ones(4, 1)
    with pytest.raises(ValueError, match="0..15"):
        kernels.pack_q4_1(d, d, torch.full((4, 32), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.pack_q8_0(torch.ones(4, 1), torch.zeros(4, 48, dtype=torch.int8))
    with pytest.raises(ValueError, match="scales"):
        kernels.pack_q8_0(torch.ones(4, 2), torch.zeros(4, 32, dtype=torch.int8))
    with pytest.raises(ValueError, match="not a float16"):  # the panels keep GGUF's float16 scales
        kernels.pack_q4_0(torch.full((4, 1), 0.1), torch.zeros(4, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole blocks"):
        QuantBlocks("Q4_1", torch.zeros(4, 21, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unsupported"):
        QuantBlocks("Q5_1", torch.zeros(4, 24, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole blocks"):
        QuantBlocks("Q6_K", torch.zeros(4, 105, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.pack_q6_k(torch.ones(4, 1), torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..63"):
        kernels.pack_q6_k(torch.ones(4, 1), torch.zeros(4, 16, dtype=torch.int8),
                          torch.full((4, 256), 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="sub-scales values must be in 0..63"):
        sub = torch.full((4, 8), 64, dtype=torch.uint8)
        kernels.pack_q4_k(torch.ones(4, 1), torch.ones(4, 1), sub, sub, torch.zeros(4, 256, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales must be a contiguous torch.int8"):  # Q6_K's sub-scales are signed
        kernels.pack_q6_k(torch.ones(4, 1), torch.zeros(4, 16, dtype=torch.uint8),
                          torch.zeros(4, 256, dtype=torch.uint8))


def test_make_packed_weight_picks_the_smallest_exact_format(kernels: CpuKernels) -> None:
    blocks, w = gguf_blocks("Q4_1", 96, 64)
    fmt = lambda *a, **k: make_packed_weight(*a, **k).panels.fmt  # noqa: E731
    assert fmt(w, kernels, blocks, compact=True) == "q4_1"
    assert fmt(w, kernels, blocks, compact=False) == "f32"
    assert fmt(w.bfloat16().float(), kernels, None, compact=True) == "bf16"
    assert fmt(torch.randn(96, 64), kernels, None, compact=True) == "f32"
    # blocks that do not reproduce the weight (here: another weight's) are not used: float32 panels
    other, _ = gguf_blocks("Q4_1", 96, 64, seed=1)
    packed = make_packed_weight(w, kernels, other, compact=True)
    assert isinstance(packed, NativeWeight) and packed.panels.fmt == "f32"
    assert torch.equal(kernels.unpack(packed.panels), w)


def test_blocks_round_trip_through_the_cache_folder(tmp_path: Path) -> None:
    blocks = {"a.weight": gguf_blocks("Q8_0", 3, 64)[0], "b.weight": gguf_blocks("Q4_0", 5, 32)[0]}
    save_gguf_blocks(tmp_path, blocks)
    loaded = load_gguf_blocks(tmp_path)
    assert {k: (v.qtype, v.raw.tolist()) for k, v in loaded.items()} == \
        {k: (v.qtype, v.raw.tolist()) for k, v in blocks.items()}
    assert load_gguf_blocks(tmp_path / "elsewhere") == {}


def test_no_blocks_and_unreadable_blocks_leave_the_weights_dense(tmp_path: Path) -> None:
    save_gguf_blocks(tmp_path / "none", {})  # a GGUF with no Q8_0/Q4_0/Q4_1 tensor (a K-quant, say)
    assert not (tmp_path / "none" / BLOCKS_FILE).exists() and load_gguf_blocks(tmp_path / "none") == {}
    broken = tmp_path / "broken" / BLOCKS_FILE
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{},trailing")
    assert load_gguf_blocks(tmp_path / "broken") == {}


def test_extraction_keeps_only_blocks_that_reproduce_the_checkpoint() -> None:
    """On the bundled GGUF: a weight that matches is kept; one that differs by one value, or has another
    shape, is left dense instead of failing the conversion."""
    from transformers import AutoConfig

    folder = resolve_model(None).folder
    cfg = AutoConfig.from_pretrained(str(folder))
    good = dict(iter_weights(folder, progress=False))
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.1.self_attn.q_proj.weight"]
    state = {n: good[n].clone() for n in names}
    state[names[1]][3, 5] += 1e-3  # no longer the GGUF's values
    state[names[2]] = state[names[2]][:, :64].contiguous()  # not the GGUF tensor's shape
    blocks = extract_gguf_blocks(Path(default_model_path()), cfg, state)
    assert list(blocks) == [names[0]] and blocks[names[0]].qtype == "Q4_1"


def test_runner_packs_a_bf16_valued_model_as_bf16(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama_bf16_values")
    compact = ModelRunner(ModelConfig(model=str(folder), device="cpu", block_size=4), progress=False).model
    dense_cfg = ModelConfig(model=str(folder), cpu_compact_weights=False, device="cpu")
    dense = ModelRunner(dataclasses.replace(dense_cfg, block_size=4), progress=False).model
    assert native_weight(compact.model.layers[1].mlp.gate_up_proj.packed).panels.fmt == "bf16"
    assert native_weight(compact.lm_head.packed).panels.fmt == "bf16"
    assert native_weight(dense.model.layers[1].mlp.gate_up_proj.packed).panels.fmt == "f32"


def test_a_weight_of_mixed_block_types_is_packed_in_parts(kernels: CpuKernels) -> None:
    """Q4_K_M's fused q/k/v: rows of Q4_K then of Q6_K, each range in its own panels; the products equal the
    float32 panels' bit for bit (one product per range, into its columns), with and without a bias."""
    from cbserve.worker.cpu.gguf_blocks import SplitBlocks, fuse_blocks
    from cbserve.worker.cpu.linear import SplitWeight, native_panels

    (q, wq), (k, wk), (v, wv) = (gguf_blocks(t, n, 256, seed=n) for t, n in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)))
    blocks = fuse_blocks([q, k, v])
    assert isinstance(blocks, SplitBlocks) and [b.qtype for b in blocks.parts] == ["Q4_K", "Q6_K"]
    w = torch.cat([wq, wk, wv])
    packed = make_packed_weight(w, kernels, blocks, compact=True)
    assert isinstance(packed, SplitWeight) and [p.fmt for p in native_panels(packed)] == ["q4_k", "q6_k"]
    gen = torch.Generator().manual_seed(0)
    bias, dense = torch.randn(128, generator=gen), kernels.pack_weight(w)
    for m in (1, 3, 40):
        x = torch.randn(m, 256, generator=gen)
        assert torch.equal(packed.matmul(x, bias), kernels.linear(x, dense, bias))
    assert fuse_blocks([q, k]).qtype == "Q4_K"  # one type: one QuantBlocks
