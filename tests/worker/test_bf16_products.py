"""``dtype="bfloat16"`` on the CPU kernels: the linear layers multiply bfloat16-rounded inputs by bfloat16-
rounded weights (the CB_FMT_BF16_DOT panels, AVX-512 BF16's ``vdpbf16ps`` where the CPU has it, float32 FMAs
where not) with float32 sums; norms, attention, the KV cache and the residual stream stay float32.

Checked: the kernel against a float64 product of the same rounded operands (every shape class: one row,
a row block and more, odd k, a partial last panel, bias), the portable build against the AVX-512 BF16 one,
and the bundled model against HF transformers run in bfloat16 on the same weights: greedy tokens equal
until a position where the two models' top tokens are near-tied, where each one's token is in the other's
top 5 (what bfloat16 rounding can flip, vLLM's check for lower-precision paths)."""

from __future__ import annotations

import pytest
import torch
from worker_testlib import run_engine

from cbserve.frontend.text.tokenizer import load_tokenizer
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.linear import native_weight
from cbserve.worker.loading.model_loader import resolve_model
from cbserve.worker.runner.executor import LocalExecutor

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

MAX_NEW = 16
TOP = 5


def rounded_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.bfloat16().double() @ w.bfloat16().double().T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize(("m", "n", "k"), [(1, 5, 3), (7, 49, 64), (17, 100, 577), (200, 97, 130), (9, 50, 1),
                                           (33, 48, 256), (17, 60, 1100)])  # k 1100: chunks of 512 pairs and a tail
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_dot_linear_is_the_product_of_rounded_operands(
    kernels: CpuKernels, m: int, n: int, k: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = kernels.pack_weight(w, "bf16_dot")
    assert packed.nbytes == -(-n // 48) * 48 * (k + k % 2) * 2
    assert torch.equal(kernels.unpack(packed), w.bfloat16().float())
    out = kernels.linear(x, packed, bias)
    ref = rounded_product(x, w, bias)
    scale = x.bfloat16().double().abs() @ w.bfloat16().double().abs().T
    assert ((out.double() - ref).abs() <= 1e-6 * scale + 1e-6).all()
    # not the float32 product: the rounding is real (so the test above could fail)
    assert not torch.allclose(out, x @ w.T + (bias if bias is not None else 0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("m", [1, 9, 40])
def test_gguf_blocks_with_bf16_products_equal_bf16_dot_panels_of_their_values(
    kernels: CpuKernels, qtype: str, m: int
) -> None:
    """Kept compact, the blocks' decoded weights are rounded as the kernel reads them: the same products, bit
    for bit, as "bf16_dot" panels of the decoded float32 weight."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from cbserve.worker.cpu.gguf_blocks import QuantBlocks

    w = np.random.default_rng(m).normal(0.0, 0.05, size=(100, 320)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[qtype])
    blocks = QuantBlocks(qtype, torch.from_numpy(raw))
    decoded = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))
    packed = kernels.pack_blocks(blocks)
    as_bf16 = kernels.with_bf16_products(packed)
    assert as_bf16.fmt == qtype.lower() + "_bf16" and as_bf16.data is packed.data
    assert torch.equal(kernels.unpack(as_bf16), decoded.bfloat16().float())
    x, bias = torch.randn(m, 320, generator=torch.Generator().manual_seed(m)), torch.randn(100)
    dense = kernels.pack_weight(decoded, "bf16_dot")
    assert torch.equal(kernels.linear(x, as_bf16, bias), kernels.linear(x, dense, bias))
    with pytest.raises(ValueError, match="bfloat16-products variant"):
        kernels.with_bf16_products(kernels.pack_weight(decoded))
    # cpu_compact_weights under bf16 products: the blocks kept, or (off) every weight rounded into pairs
    from cbserve.worker.cpu.linear import make_packed_weight

    for compact, fmt in ((True, as_bf16.fmt), (False, "bf16_dot")):
        packed_weight = make_packed_weight(decoded, kernels, blocks, compact=compact, bf16_products=True)
        assert packed_weight.panels.fmt == fmt  # type: ignore[union-attr]


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
def test_one_row_through_blocks_equals_the_tiled_path_bit_for_bit(kernels: CpuKernels, qtype: str) -> None:
    """A decode step's single row takes its own path through GGUF blocks (decoded straight into the sums); it
    must give what the tiled path gives the same row in a batch: the same products in the same order."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from cbserve.worker.cpu.gguf_blocks import QuantBlocks

    w = np.random.default_rng(7).normal(0.0, 0.05, size=(150, 576)).astype(np.float32)  # a partial last panel
    blocks = QuantBlocks(qtype, torch.from_numpy(quantize(w, GGMLQuantizationType[qtype])))
    packed = kernels.pack_blocks(blocks)
    packed = kernels.with_bf16_products(packed)
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(2, 576, generator=gen), torch.randn(150, generator=gen)
    for b in (None, bias):
        batch = kernels.linear(x, packed, b)
        assert torch.equal(kernels.linear(x[:1], packed, b), batch[:1])
        assert torch.equal(kernels.linear(x[1:], packed, b), batch[1:])


def test_bf16_dot_reads_strided_rows(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    w, big = torch.randn(60, 40, generator=gen), torch.randn(12, 70, generator=gen)
    x = big[:, 3:43]  # rows 70 floats apart
    packed = kernels.pack_weight(w, "bf16_dot")
    assert torch.allclose(kernels.linear(x, packed, None), kernels.linear(x.contiguous(), packed, None), atol=0)


def test_portable_build_gives_the_avx512_bf16_results(kernels: CpuKernels) -> None:
    """The kernel without AVX-512 (the avx2 level's build: x86-64-v3 on an AVX-512 CPU, AVX2 FMAs on the same
    rounded values) against this machine's build: equal within float32 summation order."""
    if "avx2" not in cpu_native.supported_levels():
        pytest.skip("this CPU does not run the avx2 build")
    portable = cpu_native.load_cpu_kernels("avx2").kernels
    assert portable is not None and "avx512_bf16" not in portable.isa_features
    gen = torch.Generator().manual_seed(9)
    w, x, bias = torch.randn(130, 333, generator=gen), torch.randn(45, 333, generator=gen), torch.randn(130)
    p_native, p_portable = kernels.pack_weight(w, "bf16_dot"), portable.pack_weight(w, "bf16_dot")
    assert torch.equal(p_native.data, p_portable.data)
    a, b = kernels.linear(x, p_native, bias), portable.linear(x, p_portable, bias)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    q = torch.randint(-127, 128, (130, 320), dtype=torch.int8, generator=gen)
    d = (torch.rand(130, 10, generator=gen) * 0.01).half().float()  # GGUF's float16 scales
    q8_native = kernels.with_bf16_products(kernels.pack_q8_0(d, q))
    q8_portable = portable.with_bf16_products(portable.pack_q8_0(d, q))
    x = x[:, :320].contiguous()
    a, b = kernels.linear(x, q8_native, None), portable.linear(x, q8_portable, None)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def _hf_greedy_with_top(model: object, prompt: list[int]) -> tuple[list[int], list[list[int]]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,  # type: ignore[attr-defined]
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tops = [s[0].float().topk(TOP).indices.tolist() for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), tops


def test_bundled_model_in_bf16_tracks_hf_bf16() -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    folder = resolve_model(None).folder
    tok = load_tokenizer(folder)
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "List three colors: red,",
             "Once upon a time, in a small village by the sea, there lived"]
    prompts = [tok(t)["input_ids"] for t in texts]
    # the C kernels' path (cpu_ops "auto" may pick oneDNN where its probe times it faster, as on a Zen 4 EPYC)
    ex = LocalExecutor(ModelConfig(dtype="bfloat16", device="cpu", block_size=16, cpu_ops="native"), num_blocks=64,
                       progress=False)
    assert ex.runner.dtype == torch.float32 and ex.runner.kv_caches[0][0].dtype == torch.float32
    # the GGUF's Q4_1 / Q8_0 blocks stay compact, rounded to bfloat16 as the kernel decodes them
    assert native_weight(ex.runner.model.model.layers[0].mlp.down_proj.packed).panels.fmt == "q4_1_bf16"
    assert native_weight(ex.runner.model.lm_head.packed).panels.fmt == "q8_0_bf16"
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP)
    run = run_engine(ex, [(f"r{i}", p, sp) for i, p in enumerate(prompts)], block_size=16, num_blocks=64,
                     max_num_batched_tokens=24, max_num_seqs=4)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    exact = 0
    for i, p in enumerate(prompts):
        ours, (theirs, their_top) = run.tokens[f"r{i}"][0], _hf_greedy_with_top(hf, p)
        at = _first_difference(ours, theirs)
        if at is None:
            exact += 1
            continue
        our_top = [t for t, _ in run.logprobs[f"r{i}"][0][at].top]
        assert theirs[at] in our_top and ours[at] in their_top[at], (texts[i], at, ours, theirs)
    assert exact >= 2  # most prompts agree token for token over all MAX_NEW tokens
