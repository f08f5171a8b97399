"""Every ISA build of the C kernels (csrc/, built per level by native.py: avx512, avx2, scalar) gives the float64
reference's results and the others', kernel by kernel: on this machine for each level it runs, and each level's
build cross-compiled (x86-64-v3, x86-64-v4, sapphirerapids) reports the ISA it was built for. The choice of a
level (the CPU's flags, a forced lower one, a refused higher one) is tested on stand-in flag sets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

LEVELS = cpu_native.supported_levels()
V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2"})
V4 = V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.fixture(scope="module")
def builds() -> dict[str, CpuKernels]:
    out = {}
    for level in LEVELS:
        load = cpu_native.load_cpu_kernels(level)
        assert load.kernels is not None, load.reason
        assert load.isa == level and load.kernels.isa == level
        out[level] = load.kernels
    return out


def test_levels_follow_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "_is_x86", lambda: True)
    assert cpu_native.supported_levels(V4) == ("avx512", "avx2", "scalar")
    assert cpu_native.supported_levels(V3 | {"avx512f"}) == ("avx2", "scalar")  # AVX-512 F alone is not v4
    assert cpu_native.supported_levels(frozenset({"sse2", "avx"})) == ("scalar",)
    assert cpu_native.resolve_isa("auto", V3) == "avx2"
    assert cpu_native.resolve_isa("avx2", V4) == "avx2"  # a lower level runs natively
    with pytest.raises(ValueError, match="this CPU runs only avx2, scalar"):
        cpu_native.resolve_isa("avx512", V3)
    with pytest.raises(ValueError, match="cpu_isa must be"):
        cpu_native.resolve_isa("sse9", V4)
    # the best level is built for this CPU itself; a forced lower one for its own architecture
    assert cpu_native.level_flag_sets("avx512", "avx512")[0] == ("-march=native", "-fopenmp")
    assert cpu_native.level_flag_sets("avx2", "avx2")[0] == ("-march=native", "-mno-avx512f", "-fopenmp")
    assert cpu_native.level_flag_sets("avx2", "avx512")[0] == ("-march=x86-64-v3", "-mtune=native", "-fopenmp")
    assert cpu_native.level_flag_sets("scalar", "avx512")[0] == ("-march=x86-64", "-mtune=native", "-fopenmp")
    monkeypatch.setattr(cpu_native, "_is_x86", lambda: False)
    assert cpu_native.supported_levels(V4) == ("scalar",)


@pytest.mark.parametrize("march,bits", [("x86-64-v3", {"avx2"}), ("x86-64-v4", {"avx2", "avx512"}),
                                        ("sapphirerapids", {"avx2", "avx512", "avx512_bf16", "amx", "i16_dot"}),
                                        ("icelake-server", {"avx2", "avx512", "i16_dot"}),
                                        ("alderlake", {"avx2", "i16_dot"}), ("x86-64", set())])
def test_cross_compiled_builds_report_their_isa(march: str, bits: set[str], tmp_path: Path) -> None:
    """Each level compiles for its architecture whatever this CPU is; the library's own report says which
    (a function returning a constant: safe to call on any x86-64). Unoptimized (-O0 after the release flags): what
    the report says depends on -march alone, and the six builds take 30 s instead of 78 on a 2-core Zen 4 (the
    release flags compile the levels this CPU runs, in the tests that load them)."""
    cc = cpu_native._compiler()
    assert cc is not None
    lib = tmp_path / f"{march}.so"
    complaint = cpu_native._compile(cc, (*cpu_native._BASE_FLAGS, "-O0", f"-march={march}", "-fopenmp"), lib)
    if complaint is not None and "march" in complaint:
        pytest.skip(f"this compiler does not know -march={march}: {complaint}")
    assert complaint is None, complaint
    assert set(CpuKernels(lib).isa_features) == bits


def test_a_wrong_build_is_refused(builds: dict[str, CpuKernels]) -> None:
    for level, kernels in builds.items():
        assert cpu_native._check_level(kernels, level) is None
        for other in set(cpu_native.ISA_LEVELS) - {level}:
            assert "reports" in str(cpu_native._check_level(kernels, other))


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


def _weights(kernels: CpuKernels, fmt: str, n: int, k: int, gen: torch.Generator):
    """A packing of format fmt and the float32 weight it decodes to."""
    scales = lambda: (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()  # noqa: E731 (GGUF's float16)
    if fmt in ("q8_0", "q8_0_bf16"):
        d = scales()
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        panels = kernels.pack_q8_0(d, q)
    elif fmt in ("q4_1", "q4_1_bf16"):
        d, m = scales(), -scales()
        panels = kernels.pack_q4_1(d, m, torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen))
    elif fmt == "q5_0":
        panels = kernels.pack_q5_0(scales(), torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=gen))
    elif fmt in ("q4_0", "q4_0_bf16"):
        panels = kernels.pack_q4_0(scales(), torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen))
    elif fmt in ("q4_k", "q5_k"):
        sub = lambda: torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen)  # noqa: E731
        pack = kernels.pack_q5_k if fmt == "q5_k" else kernels.pack_q4_k
        panels = pack(scales()[:, : k // 256].contiguous(), scales()[:, : k // 256].contiguous(), sub(), sub(),
                      torch.randint(0, 32 if fmt == "q5_k" else 16, (n, k), dtype=torch.uint8, generator=gen))
    elif fmt == "q6_k":
        panels = kernels.pack_q6_k(scales()[:, : k // 256].contiguous(),
                                   torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen),
                                   torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen))
    else:
        w = torch.randn(n, k, generator=gen)
        panels = kernels.pack_weight(w.bfloat16().float() if fmt == "bf16" else w, fmt)
    if fmt.endswith("_bf16"):
        panels = kernels.with_bf16_products(panels)
    return panels, kernels.unpack(panels)


FORMATS = ("f32", "bf16", "q8_0", "q4_1", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k", "bf16_dot", "q8_0_bf16", "q4_1_bf16",
           "q4_0_bf16")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 5, 9, 17, 200])
def test_linear_every_level_matches_float64_and_each_other(builds: dict[str, CpuKernels], fmt: str, m: int) -> None:
    n, k = 100, 512 if fmt.endswith("_k") else 320  # two full panels and a partial one; k in whole GGUF blocks
    results = {}
    for level, kernels in builds.items():
        gen = torch.Generator().manual_seed(m * 31 + len(fmt))
        panels, w = _weights(kernels, fmt, n, k, gen)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        if fmt.endswith(("_dot", "_bf16")):  # bfloat16 products: the rounded operands' product
            x_ref, w_ref = x.bfloat16().float(), w.bfloat16().float()
        else:
            x_ref, w_ref = x, w
        out = kernels.linear(x, panels, bias)
        ref = _reference(x_ref, w_ref, bias)
        bound = 4e-7 * k * (x_ref.double().abs() @ w_ref.double().abs().t() + bias.double().abs())
        assert ((out.double() - ref).abs() <= bound + 1e-6).all(), (level, fmt, m)
        results[level] = out
    # FMA builds sum each output in k order from the same start: bit for bit the same
    fma = [results[level] for level in ("avx512", "avx2") if level in results and not fmt.endswith(("dot", "_bf16"))]
    for other in fma[1:]:
        assert torch.equal(other, fma[0])


def _all_levels(builds: dict[str, CpuKernels], run, atol: float, rtol: float = 1e-5, exact: bool = False) -> None:
    outs = {level: run(kernels) for level, kernels in builds.items()}
    first = next(iter(outs.values()))
    for level, out in outs.items():
        if exact:
            assert torch.equal(out, first), level
        else:
            torch.testing.assert_close(out, first, atol=atol, rtol=rtol, msg=level)


def test_elementwise_every_level(builds: dict[str, CpuKernels]) -> None:
    gen = torch.Generator().manual_seed(3)
    x, r, w = torch.randn(37, 200, generator=gen), torch.randn(37, 200, generator=gen), torch.randn(200, generator=gen)
    ref = (w.double() * (x + r).double() * torch.rsqrt(((x + r).double() ** 2).mean(-1, keepdim=True) + 1e-6)).float()
    for kernels in builds.values():
        out, _ = kernels.add_rms_norm(x, r.clone(), w, 1e-6)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    gu = torch.randn(37, 2 * 300, generator=gen) * 4
    g, u = gu[:, :300].double(), gu[:, 300:].double()
    silu = (g * torch.sigmoid(g) * u).float()
    gelu = (0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u).float()
    for kernels in builds.values():
        torch.testing.assert_close(kernels.silu_and_mul(gu), silu, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kernels.gelu_tanh_and_mul(gu), gelu, atol=1e-5, rtol=1e-5)
    pos = torch.randint(0, 50, (37,), generator=gen)
    cos, sin = torch.randn(50, 64, generator=gen), torch.randn(50, 64, generator=gen)

    def rotary(kernels: CpuKernels) -> torch.Tensor:
        y = torch.randn(37, 3 * 64, generator=torch.Generator().manual_seed(4))
        kernels.rotary_(y, 64, pos, cos, sin)
        return y

    _all_levels(builds, rotary, atol=1e-5)


def test_bitmask_and_top_p_every_level(builds: dict[str, CpuKernels]) -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 1000  # not a multiple of 32: the last word's bits past the vocabulary are not tokens
    mask = torch.randint(-(2**31), 2**31 - 1, (4, 32), dtype=torch.int32, generator=gen)
    mask[1] = -1  # all ones: nothing masked
    logits = torch.randn(4, vocab, generator=gen)
    bits = (mask.view(-1, 1).bitwise_right_shift(torch.arange(32, dtype=torch.int32)) & 1).view(4, -1)[:, :vocab]
    expected = logits.masked_fill(bits == 0, -math.inf)
    _all_levels(builds, lambda k: k.apply_token_bitmask_(logits.clone(), mask), atol=0, exact=True)
    assert torch.equal(next(iter(builds.values())).apply_token_bitmask_(logits.clone(), mask), expected)
    probs = torch.softmax(torch.randn(6, 5000, generator=gen) * 3, dim=-1)
    _all_levels(builds, lambda k: k.top_p_threshold(probs, [0.5, 0.9, 0.99, 1.0, 0.1, 0.75]), atol=0, exact=True)


def _attention_reference(q, k_cache, v_cache, tables, lens, scale, bs):
    n, heads, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        slots = [int(tables[i, t // bs]) * bs + t % bs for t in range(int(lens[i]))]
        keys = k_cache.reshape(-1, kvh, d)[slots].double()
        vals = v_cache.reshape(-1, kvh, d)[slots].double()
        for h in range(heads):
            p = torch.softmax(keys[:, h // (heads // kvh)] @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ vals[:, h // (heads // kvh)]
    return out


@pytest.mark.parametrize("d,heads,kv_heads", [(64, 9, 3), (128, 4, 4), (80, 4, 2)])
def test_paged_attention_every_level(builds: dict[str, CpuKernels], d: int, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(d + heads)
    bs, num_blocks = 16, 40
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    lens = torch.tensor([1, 17, 100, 101, 102, 300], dtype=torch.int32)  # 100-102: one sequence's run of rows
    tables = torch.randint(0, num_blocks, (6, 19), dtype=torch.int32, generator=gen)
    tables[3:5] = tables[2]
    q = torch.randn(6, heads, d, generator=gen)
    ref = _attention_reference(q, k_cache, v_cache, tables, lens, d**-0.5, bs)
    for level, kernels in builds.items():
        out = torch.empty_like(q)
        kernels.paged_decode(q, out, k_cache, v_cache, tables, lens, 300, d**-0.5)
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5, msg=level)
