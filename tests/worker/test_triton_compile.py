"""Compile every Triton kernel ahead of time for an H100 (sm_90, bf16; the attention kernels in float32 too)
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
_KV_WRITE = dict(key_ptr=_PTR, value_ptr=_PTR, k_cache_ptr=_PTR, v_cache_ptr=_PTR, slot_ptr="*i64",
                 stride_k_tok="i32", stride_k_head="i32", stride_v_tok="i32", stride_v_head="i32",
                 stride_c_blk="i64", stride_c_off="i32", stride_c_head="i32")
_PREFILL = dict(q_ptr=_PTR, k_cache_ptr=_PTR, v_cache_ptr=_PTR, out_ptr=_PTR, block_tables_ptr="*i32",
                cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32", softcap="fp32", window="i32",
                stride_q_tok="i32",
                stride_q_head="i32", stride_o_tok="i32", stride_o_head="i32", stride_c_blk="i64",
                stride_c_off="i32", stride_c_head="i32", stride_bt="i32")
_DECODE = dict(q_ptr=_PTR, k_cache_ptr=_PTR, v_cache_ptr=_PTR, block_tables_ptr="*i32", seq_lens_ptr="*i32",
               mid_o_ptr="*fp32", mid_lse_ptr="*fp32", qk_scale="fp32", softcap="fp32", window="i32",
               stride_q_tok="i32",
               stride_q_head="i32", stride_c_blk="i64", stride_c_off="i32", stride_c_head="i32",
               stride_bt="i32", stride_mo_req="i32", stride_mo_head="i32", stride_mo_split="i32",
               stride_ml_req="i32", stride_ml_head="i32")
_MERGE = dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=_PTR, stride_mo_req="i32",
              stride_mo_head="i32", stride_mo_split="i32", stride_ml_req="i32", stride_ml_head="i32",
              stride_o_tok="i32", stride_o_head="i32")



def _fp32(types: dict[str, str]) -> dict[str, str]:
    return {a: "*fp32" if t == _PTR else t for a, t in types.items()}


# (kernel name, arg types, constexprs, dtype of the K/V cache) at Llama-3-8B shapes (GQA 4, head_dim 128, block
# 16); the launchers' DOT_PRECISION for that dtype is added to the attention kernels' constexprs
CASES = [
    ("_kv_write_kernel", _KV_WRITE, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8,
                                         BLOCK_D=128), "bfloat16"),
    ("_prefill_kernel", _PREFILL, dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64,
                                       BLOCK_D=128, SOFTCAP=False), "bfloat16"),
    ("_decode_split_kernel", _DECODE, dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, NUM_SPLITS=8, BLOCK_H=16,
                                           BLOCK_N=64, BLOCK_D=128, SOFTCAP=False), "bfloat16"),
    # Gemma 2 shapes with logit soft-capping (GQA 2, head_dim 256 at 9B; 128 here for the shared memory)
    ("_prefill_kernel", _PREFILL, dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64,
                                       BLOCK_D=128, SOFTCAP=True), "bfloat16"),
    ("_decode_split_kernel", _DECODE, dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, NUM_SPLITS=8, BLOCK_H=16,
                                           BLOCK_N=64, BLOCK_D=128, SOFTCAP=True), "bfloat16"),
    ("_decode_merge_kernel", _MERGE, dict(NUM_SPLITS=8, HEAD_DIM=128, BLOCK_S=8, BLOCK_D=128), "bfloat16"),
    # dtype: float32 (the launchers' tiles: 64 x 64 prefill, 64-key decode)
    ("_prefill_kernel", _fp32(_PREFILL), dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64,
                                              BLOCK_D=128, SOFTCAP=False), "float32"),
    ("_decode_split_kernel", _fp32(_DECODE), dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, NUM_SPLITS=8,
                                                  BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, SOFTCAP=False), "float32"),
]


_SCRIPT = """
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cbserve.worker.attention import triton_jit
from cbserve.worker.attention.triton_kernels import dot_precision
for name, types, consts, dtype in json.loads(sys.argv[1]):
    fn = getattr(triton_jit, name)
    if "DOT_PRECISION" in fn.arg_names:
        consts["DOT_PRECISION"] = dot_precision(torch.empty(0, dtype=getattr(torch, dtype)))
    if set(types) | set(consts) != set(fn.arg_names):
        sys.exit(f"{name}: test signature out of date with the kernel {fn.arg_names}")
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2})
    if not k.asm.get("cubin") or k.metadata.shared > 227 * 1024:
        sys.exit(f"{name}: no cubin or too much shared memory ({k.metadata.shared})")
    print(name, dtype, "shared", k.metadata.shared, "tf32", k.asm["ptx"].count("tf32"))
"""


def test_kernels_compile_for_sm90() -> None:
    """In a fresh process without TRITON_INTERPRET: interpreted and compiled kernels cannot share one."""
    if _TRITON_SPEC is None or not _TRITON_SPEC.submodule_search_locations:
        pytest.skip("triton is not installed")
    root = next(iter(_TRITON_SPEC.submodule_search_locations))
    ptxas = os.path.join(root, "backends", "nvidia", "bin", "ptxas")
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        pytest.skip("no ptxas bundled with triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines() if " shared " in line]
    assert len(lines) == len(CASES), proc.stdout
    fp32 = [line for line in lines if line[1] == "float32"]
    assert len(fp32) == 2, proc.stdout
    assert all(line[-1] == "0" for line in fp32), f"TF32 instructions in float32 attention:\n{proc.stdout}"
