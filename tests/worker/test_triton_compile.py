"""Compile every Triton kernel ahead of time for an H100 (sm_90, bf16; the attention kernels at head_dim 64, 128
and 256, with the launchers' tiles for each head size, and in fp16 and float32 too, and over an FP8 cache)
without needing a GPU.

The interpreter runs kernels as Python, so it does not catch what only the compiler rejects (non-constexpr
globals, type errors in tl ops, shared-memory overflow). ``triton.compile`` with an explicit GPUTarget
runs the whole pipeline down to a cubin with the bundled ptxas, no driver required. The attention kernels'
``DOT_PRECISION`` is the launchers' choice for the case's dtype (``triton_kernels.dot_precision``): float32
products must compile without TF32 instructions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
_TRITON_SPEC = importlib.util.find_spec("triton")  # not imported here: it would fix interpret mode for
# the whole pytest process before the interpreter tests can set TRITON_INTERPRET

pytestmark = pytest.mark.slow

_PTR = "*bf16"
_SCALES = dict(k_scale_ptr="*fp32", v_scale_ptr="*fp32", stride_s_blk="i32", stride_s_off="i32")  # FP8 caches'
_KV_WRITE = dict(key_ptr=_PTR, value_ptr=_PTR, k_cache_ptr=_PTR, v_cache_ptr=_PTR, slot_ptr="*i64",
                 stride_k_tok="i32", stride_k_head="i32", stride_v_tok="i32", stride_v_head="i32",
                 stride_c_blk="i64", stride_c_off="i32", stride_c_head="i32", **_SCALES)
_PREFILL = dict(q_ptr=_PTR, k_cache_ptr=_PTR, v_cache_ptr=_PTR, out_ptr=_PTR, block_tables_ptr="*i32",
                cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32", softcap="fp32", window="i32",
                stride_q_tok="i32",
                stride_q_head="i32", stride_o_tok="i32", stride_o_head="i32", stride_c_blk="i64",
                stride_c_off="i32", stride_c_head="i32", stride_bt="i32", **_SCALES)
_DECODE = dict(q_ptr=_PTR, k_cache_ptr=_PTR, v_cache_ptr=_PTR, block_tables_ptr="*i32", seq_lens_ptr="*i32",
               mid_o_ptr="*fp32", mid_lse_ptr="*fp32", qk_scale="fp32", softcap="fp32", window="i32",
               stride_q_tok="i32",
               stride_q_head="i32", stride_c_blk="i64", stride_c_off="i32", stride_c_head="i32",
               stride_bt="i32", stride_mo_req="i32", stride_mo_head="i32", stride_mo_split="i32",
               stride_ml_req="i32", stride_ml_head="i32", **_SCALES)
_FP8_CACHE = dict(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
_MERGE = dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=_PTR, stride_mo_req="i32",
              stride_mo_head="i32", stride_mo_split="i32", stride_ml_req="i32", stride_ml_head="i32",
              stride_o_tok="i32", stride_o_head="i32")



def _typed(types: dict[str, str], ptr: str) -> dict[str, str]:
    return {a: ptr if t == _PTR else t for a, t in types.items()}


def _attention(head_dim: int, group: int, softcap: bool, dtype: str, kv_fp8: bool = False) -> list[tuple]:
    """The prefill and decode-split kernels at ``head_dim``; the compile script adds the launchers' CUDA tiles
    for that head size (``triton_kernels.cuda_tiles``: BLOCK_M, BLOCK_N, num_warps, num_stages). ``kv_fp8``:
    over an e4m3 cache with its scales (queries and outputs in ``dtype``)."""
    ptr = {"bfloat16": _PTR, "float16": "*fp16", "float32": "*fp32"}[dtype]
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_D=head_dim, SOFTCAP=softcap, KV_FP8=kv_fp8)
    cache = _FP8_CACHE if kv_fp8 else {}
    return [("_prefill_kernel", _typed(_PREFILL, ptr) | cache, common, dtype),
            ("_decode_split_kernel", _typed(_DECODE, ptr) | cache, dict(common, NUM_SPLITS=8, BLOCK_H=16), dtype)]


# (kernel name, arg types, constexprs, dtype of the K/V cache); the launchers' DOT_PRECISION for that dtype is
# added to the attention kernels' constexprs. Llama-3-8B shapes (GQA 4, head_dim 128, block 16) and head_dim 64
# in bf16; Gemma 2 9B (GQA 2, head_dim 256, logit soft-capping) in bf16; Gemma 3 (head_dim 256) in fp16;
# float32 at 128 and 256; the FP8 cache (kv_cache_dtype "fp8") under bf16 at 64 and 128, Gemma 2's 256 with
# soft-capping, and float32 at 128.
CASES = [
    ("_kv_write_kernel", _KV_WRITE, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8,
                                         BLOCK_D=128, KV_FP8=False), "bfloat16"),
    ("_kv_write_kernel", _KV_WRITE | _FP8_CACHE, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8,
                                                      BLOCK_D=128, KV_FP8=True), "bfloat16"),
    ("_decode_merge_kernel", _MERGE, dict(NUM_SPLITS=8, HEAD_DIM=128, BLOCK_S=8, BLOCK_D=128), "bfloat16"),
    *_attention(64, 4, False, "bfloat16"),
    *_attention(128, 4, False, "bfloat16"),
    *_attention(256, 2, True, "bfloat16"),
    *_attention(256, 2, False, "float16"),
    *_attention(128, 4, False, "float32"),
    *_attention(256, 2, False, "float32"),
    *_attention(64, 4, False, "bfloat16", kv_fp8=True),
    *_attention(128, 4, False, "bfloat16", kv_fp8=True),
    *_attention(256, 2, True, "bfloat16", kv_fp8=True),
    *_attention(128, 4, False, "float32", kv_fp8=True),
]
_SHARED_MAX = 232448  # sm_90's shared memory per block, bytes
_MAX_WORKERS = 4  # compile processes run side by side (at most one per CPU)


_SCRIPT = """
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cbserve.worker.attention import triton_jit
from cbserve.worker.attention.triton_kernels import cuda_tiles, dot_precision
shared_max = int(sys.argv[2])
for name, types, consts, dtype in json.loads(sys.argv[1]):
    fn = getattr(triton_jit, name)
    options = {"num_warps": 4, "num_stages": 2}
    if "DOT_PRECISION" in fn.arg_names:
        consts["DOT_PRECISION"] = dot_precision(torch.empty(0, dtype=getattr(torch, dtype)))
        tiles = cuda_tiles(consts["HEAD_DIM"])
        if name == "_prefill_kernel":
            consts.update(BLOCK_M=tiles.prefill_block_m, BLOCK_N=tiles.prefill_block_n)
            options = {"num_warps": tiles.prefill_warps, "num_stages": tiles.num_stages}
        else:
            consts.update(BLOCK_N=tiles.decode_block_n)
            options = {"num_warps": tiles.decode_warps, "num_stages": tiles.num_stages}
    if set(types) | set(consts) != set(fn.arg_names):
        sys.exit(f"{name}: test signature out of date with the kernel {fn.arg_names}")
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
    if not k.asm.get("cubin") or k.metadata.shared > shared_max:
        sys.exit(f"{name} {dtype} {consts}: no cubin or too much shared memory ({k.metadata.shared})")
    print(name, dtype + ("+fp8kv" if consts.get("KV_FP8") else ""), "head_dim", consts["HEAD_DIM"], "shared",
          k.metadata.shared, "tf32", k.asm["ptx"].count("tf32"))
"""


def _compile(env: dict[str, str]) -> str:
    """Compile CASES in up to _MAX_WORKERS processes side by side; returns their joined stdout."""
    workers = max(1, min(_MAX_WORKERS, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(CASES[i::workers]), str(_SHARED_MAX)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(workers)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
    return "".join(out for out, _ in outs)


def test_kernels_compile_for_sm90() -> None:
    """In fresh processes without TRITON_INTERPRET: interpreted and compiled kernels cannot share one."""
    if _TRITON_SPEC is None or not _TRITON_SPEC.submodule_search_locations:
        pytest.skip("triton is not installed")
    root = next(iter(_TRITON_SPEC.submodule_search_locations))
    ptxas = os.path.join(root, "backends", "nvidia", "bin", "ptxas")
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        pytest.skip("no ptxas bundled with triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    stdout = _compile(env)
    lines = [line.split() for line in stdout.splitlines() if " shared " in line]
    assert len(lines) == len(CASES), stdout
    assert all(int(line[5]) <= _SHARED_MAX for line in lines), stdout
    compiled = {(line[0], line[1], int(line[3])) for line in lines}
    for kernel in ("_prefill_kernel", "_decode_split_kernel"):
        assert {(kernel, "bfloat16", d) for d in (64, 128, 256)} <= compiled, stdout
        assert {(kernel, "float16", 256), (kernel, "float32", 128), (kernel, "float32", 256)} <= compiled, stdout
    for kernel in ("_prefill_kernel", "_decode_split_kernel"):
        assert {(kernel, "bfloat16+fp8kv", d) for d in (64, 128, 256)} <= compiled, stdout
        assert (kernel, "float32+fp8kv", 128) in compiled, stdout
    assert ("_kv_write_kernel", "bfloat16+fp8kv", 128) in compiled, stdout
    fp32 = [line for line in lines if line[1].startswith("float32")]
    assert len(fp32) == 6, stdout
    assert all(line[-1] == "0" for line in fp32), f"TF32 instructions in float32 attention:\n{stdout}"
