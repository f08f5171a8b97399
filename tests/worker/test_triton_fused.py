"""The fused Triton kernels of the CUDA decoder layer (``cbserve/worker/cuda/triton_fused.py``) against the torch paths
they replace: ``RMSNorm`` (residual add + norm, plain and Gemma's 1 + w form, and the per-head q/k norm),
``apply_rotary`` / ``TorchRope`` (rotate-half, the only convention the models use; no partial rotary: the rope
tables refuse it) and ``SiluAndMul`` / ``GeluTanhAndMul``.

float32 within float32 rounding; bfloat16 and float16 with the reference's own rounding order, so nearly every
element is bit-equal (the residual sum and the rotary always are) and none is more than two ulps off (the last bit
of ``exp`` or of the norm's float32 sum can flip an intermediate rounding). The references run on CPU tensors.
Without a CUDA GPU the kernels run on CPU tensors too, under ``TRITON_INTERPRET=1`` (conftest.py); on a GPU the
same tests run them compiled. The layers' routing (``layers.use_triton``) is unit-tested, and the layers' fused
branches run with the predicate forced on. ``test_kernels_compile_for_sm90`` compiles every kernel for an H100 with
the launchers' tiles and checks shared memory, registers and that nothing spills.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest
from sm90_compile_lib import assert_sm90_builds_fit
from worker_testlib import interpreted_triton

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
triton = pytest.importorskip("triton")

from cbserve.worker.layers import basic as layers  # noqa: E402
from cbserve.worker.layers import rotary  # noqa: E402
from cbserve.worker.layers.basic import GeluTanhAndMul, RMSNorm, SiluAndMul, use_triton  # noqa: E402
from cbserve.worker.layers.rotary import RotaryEmbedding, TorchRope, TritonRope  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# compiled on a GPU: every rows x hidden; interpreted (minutes on CPU): one row count per hidden size, the odd
# row count on the masked tile
SHAPES = ([(rows, hidden) for rows in (1, 3, 17) for hidden in (64, 96, 576)] if CUDA
          else [(1, 64), (17, 96), (3, 576)])
EPS = 1e-6


@pytest.fixture(scope="module")
def tf() -> ModuleType:
    """The kernels module, interpreted without CUDA (re-imported if it was imported before the interpreter was
    switched on; skipped if triton itself was)."""
    from cbserve.worker.cuda import triton_fused

    if not CUDA:
        interpreted_triton(triton_fused, probe="_rotary_kernel")
    return triton_fused


def _close(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """Asserts out is ref up to rounding: float32 within float32 rounding (atol: GeLU's far tail, where 0.5 g
    (1 + tanh) cancels, is 0 or 1e-6); bfloat16/float16 within two ulps (one ulp of an intermediate rounding, the
    activation before the product or the normed row before the weight, can move the result by two). Returns
    (bit-equal elements, elements)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    out, ref = out.cpu(), ref.cpu()
    eps = 1e-5 if ref.dtype == torch.float32 else 2 * torch.finfo(ref.dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=eps, atol=1e-5)
    return int((out == ref).sum()), out.numel()


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, min_exact: float = 0.99) -> None:
    """``_close``, and for bfloat16/float16 at least ``min_exact`` of the elements bit-equal (the same rounding
    order as the reference)."""
    _assert_exact([_close(out, ref)], ref.dtype, min_exact)


def _assert_exact(counts: list[tuple[int, int]], dtype: torch.dtype, min_exact: float) -> None:
    exact = sum(c[0] for c in counts) / max(1, sum(c[1] for c in counts))
    assert dtype == torch.float32 or exact >= min_exact, f"only {exact:.4f} of the elements bit-equal"


def _norm_layer(hidden: int, dtype: torch.dtype, gemma: bool, gen: torch.Generator) -> RMSNorm:
    """The torch-path layer (no C kernels, on CPU) with random weights: x's dtype, or Gemma's float32 1 + w."""
    layer = RMSNorm(hidden, EPS, None, gemma)
    w = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    layer.weight.data = w if gemma else w.to(dtype)
    return layer


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _dev(t: torch.Tensor) -> torch.Tensor:
    """A copy on DEVICE: the references are computed on CPU tensors (on CUDA the layers would route to the
    kernels themselves), the kernels run on copies."""
    return t.to(DEVICE, copy=True)


@pytest.mark.cuda
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(tf: ModuleType, dtype: torch.dtype, with_residual: bool, gemma: bool) -> None:
    """Rows 1, 3, 17 x hidden 64, 96 (a masked tile), 576, in one tile and in the two-pass kernel of long rows:
    the normed rows as RMSNorm's torch path gives them; the sum x + residual bit-equal to torch's, written into
    the residual in place; x untouched."""
    gen = torch.Generator().manual_seed(0)
    counts = []
    for rows, hidden in SHAPES:
        layer = _norm_layer(hidden, dtype, gemma, gen)
        x = _randn(rows, hidden, gen=gen, dtype=dtype, scale=3.0)
        residual = _randn(rows, hidden, gen=gen, dtype=dtype, scale=4.0) if with_residual else None
        want, want_sum = layer(x, None if residual is None else residual.clone())
        x_in, w = _dev(x), _dev(layer.weight.detach())
        for max_tile in (tf.MAX_NORM_TILE, 64):  # 64: rows of 96 and 576 through the two-pass kernel
            res_in = None if residual is None else _dev(residual)
            out, new_sum = tf.add_rms_norm(x_in, res_in, w, EPS, gemma, max_tile=max_tile)
            counts.append(_close(out, want))
            assert torch.equal(new_sum.cpu(), want_sum)
            assert new_sum is (x_in if res_in is None else res_in)
            assert torch.equal(x_in.cpu(), x)
    _assert_exact(counts, dtype, 0.99)


@pytest.mark.cuda
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_heads_of_a_qkv_slice(tf: ModuleType, dtype: torch.dtype, gemma: bool) -> None:
    """Per-head q/k norms (Qwen3, Gemma 3) read straight out of the fused qkv output (a strided view): equal to
    ``RMSNorm.norm_heads``'s torch path, a new contiguous tensor, the qkv buffer untouched."""
    gen = torch.Generator().manual_seed(1)
    counts = []
    for tokens, head_dim in [(1, 64), (3, 128), (17, 256), (5, 96)]:
        heads = 3
        layer = _norm_layer(head_dim, dtype, gemma, gen)
        qkv = _randn(tokens, (heads + 2) * head_dim, gen=gen, dtype=dtype, scale=2.0)
        qkv_in = _dev(qkv)
        k = qkv_in[:, head_dim : (heads + 1) * head_dim].view(tokens, heads, head_dim)  # strided, like q of qkv
        out = tf.rms_norm_heads(k, _dev(layer.weight.detach()), EPS, gemma)
        assert out.is_contiguous()
        want = layer.norm_heads(qkv[:, head_dim : (heads + 1) * head_dim].view(tokens, heads, head_dim))
        counts.append(_close(out, want))
        assert torch.equal(qkv_in.cpu(), qkv)
    _assert_exact(counts, dtype, 0.99)


def _rope(head_dim: int, max_positions: int = 64) -> RotaryEmbedding:
    return RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), head_dim, max_positions)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
def test_rotary_q_and_k_in_place(tf: ModuleType, dtype: torch.dtype, head_dim: int) -> None:
    """q (3 heads) and k (2 heads) rotated together in place inside the fused qkv output, as the decoder does:
    bit-equal to ``TorchRope`` for the 16-bit dtypes (each product and sum rounded as torch rounds them), within
    float32 rounding in float32; v untouched. Tokens 1, 3, 17 at random positions (int64 and int32)."""
    gen = torch.Generator().manual_seed(head_dim)
    rope = _rope(head_dim)
    for tokens, pos_dtype in [(1, torch.int64), (3, torch.int32), (17, torch.int64)]:
        qkv = _randn(tokens, 7 * head_dim, gen=gen, dtype=dtype, scale=2.0)
        positions = torch.randint(0, 64, (tokens,), generator=gen)
        want = TorchRope(*rope.cos_sin(positions, dtype)).apply(qkv[:, : 5 * head_dim].view(tokens, 5, head_dim))
        qkv_in = _dev(qkv)
        qk = qkv_in[:, : 5 * head_dim].view(tokens, 5, head_dim)
        out = tf.rotary_(qk, _dev(positions.to(pos_dtype)), _dev(rope.cos), _dev(rope.sin))
        assert out is qk
        _assert_matches(qkv_in[:, : 5 * head_dim].view(tokens, 5, head_dim), want, 1.0)
        assert torch.equal(qkv_in[:, 5 * head_dim:].cpu(), qkv[:, 5 * head_dim:])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_rounds_tiny_and_cancelling_values_as_torch(tf: ModuleType, dtype: torch.dtype) -> None:
    """Bit-equal to ``TorchRope`` where the kernel's own rounding is tested hardest: values around float16's
    subnormals (below 2**-14, a fixed quantum of 2**-24) and x1 c - x2 s cancelling (every product rounded before
    the difference, no fused multiply-add)."""
    gen = torch.Generator().manual_seed(7)
    rope = _rope(64)
    for scale in (3e-5, 3e-4, 2.0):
        qkv = _randn(33, 4 * 64, gen=gen, dtype=dtype, scale=scale)
        positions = torch.randint(0, 64, (33,), generator=gen)
        want = TorchRope(*rope.cos_sin(positions, dtype)).apply(qkv.view(33, 4, 64))
        out = tf.rotary_(_dev(qkv).view(33, 4, 64), _dev(positions), _dev(rope.cos), _dev(rope.sin))
        assert torch.equal(out.cpu(), want), f"scale {scale}: {(out.cpu() != want).sum()} elements differ"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul(tf: ModuleType, act: str, dtype: torch.dtype) -> None:
    """act(gate) * up of [gate | up] for rows 1, 3, 17 and inter 64, 96, 1536 (two column tiles, the second
    masked), also read from a column slice of a wider buffer: as ``SiluAndMul`` / ``GeluTanhAndMul`` give it.
    GeLU's negative tail, where 1 + tanh cancels, is where the last bits of tanh show (torch's and ours), so a
    few more of its 16-bit results are an ulp apart."""
    gen = torch.Generator().manual_seed(2)
    layer = SiluAndMul() if act == "silu" else GeluTanhAndMul()
    fused = tf.silu_and_mul if act == "silu" else tf.gelu_tanh_and_mul
    counts = []
    for rows in (1, 3, 17):
        for inter in (64, 96, 1536):
            wide = _randn(rows, 2 * inter + 16, gen=gen, dtype=dtype, scale=2.0)
            wide_in = _dev(wide)
            for x, x_in in ((wide[:, : 2 * inter], _dev(wide[:, : 2 * inter])),
                            (wide[:, 8 : 8 + 2 * inter], wide_in[:, 8 : 8 + 2 * inter])):
                counts.append(_close(fused(x_in), layer(x)))
    _assert_exact(counts, dtype, 0.99 if act == "silu" else 0.98)


def test_wrappers_reject_bad_shapes(tf: ModuleType) -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        tf.add_rms_norm(x, torch.zeros(2, 9, device=DEVICE), torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="weight"):
        tf.add_rms_norm(x, None, torch.ones(9, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="even"):
        tf.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    rope = _rope(16)
    with pytest.raises(ValueError, match="head_dim"):
        tf.rotary_(torch.zeros(2, 1, 8, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE),
                   _dev(rope.cos), _dev(rope.sin))
    assert tf.silu_and_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)


def test_use_triton_routes_cuda_tensors_of_the_kernels_dtypes() -> None:
    """The layers' routing: CUDA tensors of float32/bfloat16/float16 (or positions, with the model's dtype)."""
    fake = lambda dtype, cuda=True: SimpleNamespace(is_cuda=cuda, dtype=dtype)
    assert all(use_triton(fake(dt)) for dt in DTYPES)  # type: ignore[arg-type]
    assert not use_triton(fake(torch.float64))  # type: ignore[arg-type]
    assert not use_triton(fake(torch.bfloat16, cuda=False))  # type: ignore[arg-type]
    assert use_triton(fake(torch.int64), torch.bfloat16)  # type: ignore[arg-type]
    assert not use_triton(fake(torch.int64))  # type: ignore[arg-type]
    assert not any(use_triton(torch.zeros(1, dtype=dt)) for dt in DTYPES)  # CPU: the C kernels or torch
    assert not use_triton(torch.zeros(1, device="meta"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_fused_branches(tf: ModuleType, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """With the routing forced on, the layer classes take their Triton branch (on CPU tensors: interpreted) and
    give what their torch path gives on CPU: RMSNorm with and without a residual (the sum then lands in the
    residual in place, as on the C path), per-head norms, the rope (a ``TritonRope``), SiLU- and GeLU-and-mul."""
    gen = torch.Generator().manual_seed(3)
    norm, head_norm = _norm_layer(576, dtype, False, gen), _norm_layer(64, dtype, False, gen)
    act, gelu, rope = SiluAndMul(), GeluTanhAndMul(), _rope(64)
    x, res = _randn(5, 576, gen=gen, dtype=dtype), _randn(5, 576, gen=gen, dtype=dtype)
    heads = _randn(5, 4, 64, gen=gen, dtype=dtype)
    gate_up = _randn(5, 256, gen=gen, dtype=dtype)
    positions = torch.randint(0, 64, (5,), generator=gen)
    want_norm, want_sum = norm(x, res.clone())
    want = [norm(x)[0], head_norm.norm_heads(heads), act(gate_up), gelu(gate_up)]
    want_rope = rope.prepare(positions, dtype).apply(heads.clone())

    forced = lambda x, dtype=None: True
    monkeypatch.setattr(layers, "use_triton", forced)
    monkeypatch.setattr(rotary, "use_triton", forced)
    calls: list[str] = []
    for name in ("add_rms_norm", "rms_norm_heads", "rotary_", "silu_and_mul", "gelu_tanh_and_mul"):
        fn = getattr(tf, name)
        monkeypatch.setattr(tf, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    for module in (norm, head_norm, rope):
        module.to(DEVICE)
    x, res_in, heads, gate_up = _dev(x), _dev(res), _dev(heads), _dev(gate_up)
    out, summed = norm(x, res_in)
    assert summed is res_in and torch.equal(summed.cpu(), want_sum)
    _assert_matches(out, want_norm)
    for got, ref in zip([norm(x)[0], head_norm.norm_heads(heads), act(gate_up), gelu(gate_up)], want, strict=True):
        _assert_matches(got, ref)
    fused_rope = rope.prepare(_dev(positions), dtype)
    assert isinstance(fused_rope, TritonRope)
    _assert_matches(fused_rope.apply(heads.clone()), want_rope, 1.0)
    assert calls == ["add_rms_norm", "add_rms_norm", "rms_norm_heads", "silu_and_mul", "gelu_tanh_and_mul",
                     "rotary_"]
    if dtype != torch.float32:  # a float32 weight on 16-bit rows: torch's product is float32, so torch's path
        assert _norm_layer(576, torch.float32, False, gen).to(DEVICE)(x)[0].dtype == torch.float32
        assert len(calls) == 6


_SCRIPT = r"""
from cbserve.worker.cuda import triton_fused as tf
P = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
for case in json.loads(sys.argv[1]):
    kind, dtype = case[0], case[1]
    p = P[dtype]
    if kind == "norm":
        w_dtype, n_cols, residual, round_normed = case[2:]
        block, warps, long = tf.norm_tiles(n_cols)
        fn = tf._add_rms_norm_long_kernel if long else tf._add_rms_norm_kernel
        types = dict(x_ptr=p, res_ptr=p, w_ptr=P[w_dtype], out_ptr=p, n_cols="i32", eps="fp32",
                     **({} if long else {"heads": "i32"}),
                     **{a: "i32" for a in fn.arg_names if a.startswith("stride")})
        consts = dict(HAS_RESIDUAL=residual, ROUND_NORMED=round_normed, BLOCK_N=block)
    elif kind == "rotary":
        heads, head_dim = case[2:]
        fn = tf._rotary_kernel
        block_h, block_d = tf.rotary_tiles(heads, head_dim)
        warps = 4
        types = dict(x_ptr=p, pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", heads="i32",
                     **{a: "i32" for a in fn.arg_names if a.startswith("stride")})
        consts = dict(HALF=head_dim // 2, BLOCK_H=block_h, BLOCK_D=block_d)
    else:
        act, inter = case[2:]
        fn = tf._act_and_mul_kernel
        warps = 4
        types = dict(x_ptr=p, out_ptr=p, inter="i32", **{a: "i32" for a in fn.arg_names if a.startswith("stride")})
        consts = dict(ACT=act, BLOCK=tf.act_block(inter))
    k, usage = build(fn, types, consts, {"num_warps": warps, "enable_fp_fusion": False})  # as _launch does
    print("COMPILED", json.dumps(case), "warps", warps, usage, "fma", len(re.findall(r"\bfma\.", k.asm["ptx"])))
"""

# Llama-3-8B (hidden 4096, head_dim 128, 32 + 8 heads, inter 14336) and 70B (8192), SmolLM2 (576, 64, 9 + 3),
# Gemma 2 9B (3584, Gemma norms, head_dim 256, GeLU), Phi-3-mini (head_dim 96), Llama-3-405B's 16384 rows and
# a 32768-column worst case; per-head q/k norms at 128.
CASES = [
    ["norm", "bfloat16", "bfloat16", 576, True, True], ["norm", "bfloat16", "bfloat16", 4096, True, True],
    ["norm", "bfloat16", "bfloat16", 8192, False, True], ["norm", "bfloat16", "bfloat16", 16384, True, True],
    ["norm", "bfloat16", "bfloat16", 32768, True, True], ["norm", "float16", "float16", 4096, True, True],
    ["norm", "bfloat16", "float32", 3584, True, False], ["norm", "float16", "float32", 3584, False, False],
    ["norm", "bfloat16", "bfloat16", 128, False, True],
    ["rotary", "bfloat16", 12, 64], ["rotary", "bfloat16", 40, 128], ["rotary", "bfloat16", 24, 256],
    ["rotary", "float16", 40, 128], ["rotary", "float16", 24, 256], ["rotary", "bfloat16", 64, 96],
    ["act", "bfloat16", 0, 14336], ["act", "float16", 0, 14336], ["act", "bfloat16", 1, 14336],
    ["act", "float16", 1, 64],
]


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    """Every kernel compiles to an sm_90 cubin (bfloat16 and float16, the launchers' tiles and warps) in a fresh
    process without TRITON_INTERPRET, within the shared memory of a block, at most 255 registers a thread and
    without spilling to local memory (cuobjdump's resource usage), and without a fused multiply-add in the PTX
    (each product and sum rounded as the torch path rounds it)."""
    for line in assert_sm90_builds_fit(_SCRIPT, CASES):
        assert line.endswith(" fma 0"), line
