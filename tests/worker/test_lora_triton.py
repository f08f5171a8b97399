"""The Triton multi-LoRA kernels (``cbserve/worker/lora/triton.py``) against a float64 torch reference.

Mixed batches: base rows (slot -1) interleaved with several adapters, out of order. Without a CUDA GPU the
kernels run on CPU tensors under ``TRITON_INTERPRET=1`` at small, odd sizes (the interpreter is slow); on a GPU
the same tests run compiled, plus model-sized shapes. ``test_kernels_compile_for_sm90`` compiles both kernels
for an H100 without a GPU (the interpreter does not catch what only the compiler rejects).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit decorators running
pytest.importorskip("triton")

from cbserve.worker.lora.triton import (  # noqa: E402
    LoraTiles,
    add_lora_reference,
    add_lora_triton,
    cuda_tiles,
    default_split_k,
)

DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.cuda  # the GPU suite (`pytest -m cuda`): compiled on CUDA, interpreted on CPU
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
SLOTS = [2, -1, 0, 2, 1, -1, 0]  # T = 7: base rows among three adapters, no two neighbours grouped


@pytest.fixture(scope="module", autouse=True)
def jit_module() -> ModuleType:
    """The kernels module, interpreted without CUDA (re-imported if triton was imported before the
    interpreter was switched on; skipped if triton itself was)."""
    from cbserve.worker.lora import triton_jit as lora_triton_jit

    if CUDA:
        return lora_triton_jit
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    if not isinstance(lora_triton_jit._lora_shrink_kernel, InterpretedFunction):
        importlib.reload(lora_triton_jit)  # the launcher looks kernels up on the module at each launch
    return lora_triton_jit


def _case(slots: list[int], in_f: int, out_f: int, rank: int, dtype: torch.dtype, seed: int = 0,
          num_slots: int = 3) -> tuple[torch.Tensor, ...]:
    """Random y, x, A, B (product of order 1) and the slots, on DEVICE; slot 1 uses only half its rank
    (the rest zero, as a smaller adapter in a larger slot)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), in_f, generator=gen)
    y = torch.randn(len(slots), out_f, generator=gen)
    a = torch.randn(num_slots, rank, in_f, generator=gen) / in_f**0.5
    b = torch.randn(num_slots, out_f, rank, generator=gen) / rank**0.5
    if num_slots > 1:
        a[1, rank // 2:] = 0
        b[1, :, rank // 2:] = 0
    ts = torch.tensor(slots, dtype=torch.int32)
    return tuple(t.to(dtype).to(DEVICE) if t.is_floating_point() else t.to(DEVICE) for t in (y, x, a, b, ts))


def _expected(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    ref = y.double()
    add_lora_reference(ref, x.double(), a.double(), b.double(), ts)
    return ref


def _check_against_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             ts: torch.Tensor, **kwargs: object) -> None:
    want = _expected(y, x, a, b, ts)
    before = y.clone()
    add_lora_triton(y, x, a, b, ts, **kwargs)
    tol = TOL[y.dtype]
    torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)
    base = ts < 0
    assert torch.equal(y[base], before[base])  # base rows untouched, bit for bit
    moved = (y.double() - before.double()).abs().amax(dim=1)
    assert bool((moved[~base] > 0).all())  # every adapter row got its product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_odd_sizes(dtype: torch.dtype) -> None:
    """in=96, out=80, R=24, T=7 with three adapters and base rows interleaved: equal to float64 within the
    dtype's rounding (two rank tiles, three K tiles, three N tiles with a masked tail under the interpreter)."""
    _check_against_reference(*_case(SLOTS, 96, 80, 24, dtype))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_input_dim_and_tails(split_k: int) -> None:
    """The input dim cut into 2 or 3 splits (one of them partly, at in=100 one split may be empty) gives the
    same sums; R=8 pads to a 16-row tile, out=33 leaves one live column in the last tile."""
    _check_against_reference(*_case(SLOTS, 100, 33, 8, torch.float32, seed=1), split_k=split_k)


@pytest.mark.parametrize("cols", [3 * 256, 3 * 512])
def test_fused_slots_of_rank_256_and_512(cols: int) -> None:
    """A fused q/k/v slot of rank 256 or 512 (768 or 1536 columns, as ``LoRAManager`` sizes them at
    ``max_lora_rank`` 256 / 512): many rank tiles in the shrink, a long rank loop in the expand, slot 1 at half."""
    _check_against_reference(*_case([0, -1, 1, 0], 24, 20, cols, torch.float32, seed=8, num_slots=2))


def test_float16_int64_slots_one_adapter() -> None:
    """float16, int64 slots, a single slot in the stack (S=1), odd rank 13."""
    y, x, a, b, ts = _case([0, -1, 0, 0, -1], 48, 40, 13, torch.float16, seed=2, num_slots=1)
    _check_against_reference(y, x, a, b, ts.long())


def test_strided_views_are_read_and_written_in_place() -> None:
    """y a column slice of a fused [T, 3 * out] output (as q of qkv), x a transposed (column-major) view:
    the other columns stay untouched and the slice gets the products."""
    y, x, a, b, ts = _case(SLOTS, 64, 24, 16, torch.float32, seed=3)
    fused = torch.randn(len(SLOTS), 72, device=DEVICE)
    fused[:, 24:48] = y
    x_cm = x.t().contiguous().t()
    assert x_cm.stride() == (1, len(SLOTS))
    want = _expected(y, x, a, b, ts)
    before = fused.clone()
    add_lora_triton(fused[:, 24:48], x_cm, a, b, ts)
    torch.testing.assert_close(fused[:, 24:48].double(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.equal(fused[:, :24], before[:, :24]) and torch.equal(fused[:, 48:], before[:, 48:])


def test_base_only_and_out_of_range_slots_change_nothing() -> None:
    """All rows base (-1) or naming a slot past the stack: y is left exactly as it was; T=0 is a no-op."""
    y, x, a, b, _ = _case(SLOTS, 32, 16, 8, torch.float32, seed=4)
    before = y.clone()
    ts = torch.tensor([-1, 3, -1, 7, -1, -1, 3], dtype=torch.int32, device=DEVICE)
    add_lora_triton(y, x, a, b, ts)
    assert torch.equal(y, before)
    add_lora_triton(y[:0], x[:0], a, b, ts[:0])


def test_rejects_mismatched_inputs() -> None:
    y, x, a, b, ts = _case(SLOTS, 32, 16, 8, torch.float32, seed=5)
    with pytest.raises(ValueError, match="tokens"):
        add_lora_triton(y, x[:-1], a, b, ts)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora_triton(y, x, a, b[:, :-1], ts)
    with pytest.raises(TypeError, match="int32 or int64"):
        add_lora_triton(y, x, a, b, ts.float())
    with pytest.raises(TypeError, match="share a floating dtype"):
        add_lora_triton(y, x.double(), a, b, ts)
    with pytest.raises(ValueError, match="split_k"):
        add_lora_triton(y, x, a, b, ts, split_k=17)


def test_reference_is_a_per_token_loop() -> None:
    """``add_lora_reference`` (grouped by adapter) equals the literal per-token definition in float64."""
    y, x, a, b, ts = _case(SLOTS, 20, 12, 6, torch.float64, seed=6)
    want = y.clone()
    for t, s in enumerate(SLOTS):
        if s >= 0:
            want[t] += (x[t] @ a[s].T) @ b[s].T
    add_lora_reference(y, x, a, b, ts)
    torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-12)


def test_tiles_and_split_heuristics() -> None:
    """Rank tiles pad 8 to 16 and stop at 32 (shrink) / 64 (expand); decode-sized batches split a 16k input
    dim, prefill-sized ones do not, and short inputs are never split below 1024 columns."""
    assert cuda_tiles(8)[:2] == (16, 256) and cuda_tiles(24)[:2] == (32, 128) and cuda_tiles(192)[3] == 64
    assert all(t.shrink_block_r * t.shrink_block_k == 4096 for t in map(cuda_tiles, (8, 16, 64, 192)))
    assert default_split_k(1, 1, 16384) == 16 and default_split_k(4096, 1, 16384) == 1
    assert default_split_k(1, 1, 1500) == 1 and default_split_k(8, 2, 4096) == 4


@pytest.mark.skipif(not CUDA, reason="model-sized shapes need a GPU")
@pytest.mark.parametrize(("tokens", "rank"), [(1, 16), (37, 64), (300, 192)])
def test_model_sized_on_gpu(tokens: int, rank: int) -> None:
    """Decode (T=1, split input dim) to prefill-sized batches at Llama-8B widths, bfloat16, compiled."""
    slots = [(i * 7) % 5 - 1 for i in range(tokens)]
    _check_against_reference(*_case(slots, 4096, 14336, rank, torch.bfloat16, num_slots=4))
    _check_against_reference(*_case(slots, 14336, 4096, rank, torch.bfloat16, num_slots=4))


def test_tiles_override_runs() -> None:
    """Explicit tiles (the CUDA ones for R=24) give the same result as the defaults."""
    _check_against_reference(*_case(SLOTS, 96, 80, 24, torch.float32, seed=7), tiles=LoraTiles(32, 64, 64, 32, 4))


_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cbserve.worker.lora import triton_jit as jit
from cbserve.worker.lora.triton import cuda_tiles
for dtype, rank in json.loads(sys.argv[1]):
    t = cuda_tiles(rank)
    p = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    cases = [(jit._lora_shrink_kernel, [p, p, "*fp32", "*i32"] + ["i32"] * 11,
              dict(BLOCK_R=t.shrink_block_r, BLOCK_K=t.shrink_block_k)),
             (jit._lora_expand_kernel, ["*fp32", p, p, "*i32"] + ["i32"] * 10,
              dict(NUM_SPLITS=4, BLOCK_S=4, BLOCK_N=t.expand_block_n, BLOCK_R=t.expand_block_r))]
    for fn, types, consts in cases:
        names = [a for a in fn.arg_names if a not in consts]
        if len(names) != len(types):
            sys.exit(f"{fn.fn.__name__}: test signature out of date with the kernel {fn.arg_names}")
        sig = dict(zip(names, types)) | {a: "constexpr" for a in consts}
        k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": t.num_warps})
        if not k.asm.get("cubin"):
            sys.exit(f"{fn.fn.__name__} {dtype} rank {rank}: no cubin")
        print("COMPILED", fn.fn.__name__, dtype, rank, "shared", k.metadata.shared)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    """Both kernels compile to an sm_90 cubin with the launchers' tiles (ranks 8, 64, 192; three dtypes), in a
    fresh process without TRITON_INTERPRET (interpreted and compiled kernels cannot share one)."""
    spec = importlib.util.find_spec("triton")
    root = next(iter(spec.submodule_search_locations)) if spec and spec.submodule_search_locations else ""
    if not (os.path.exists(os.path.join(root, "backends", "nvidia", "bin", "ptxas")) or shutil.which("ptxas")):
        pytest.skip("no ptxas bundled with triton")
    cases = [["bfloat16", 8], ["bfloat16", 64], ["bfloat16", 192], ["float16", 16], ["float32", 32]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("COMPILED") == 2 * len(cases), proc.stdout
