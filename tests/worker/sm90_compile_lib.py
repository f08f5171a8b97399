"""Ahead-of-time sm_90 builds of Triton kernels in a fresh process (Triton's compiler and ptxas run without a
GPU), checked against the SM's limits with the cuobjdump bundled with Triton: shared memory of a block, at most
255 registers a thread, no spills to local memory."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest

SHARED_MAX = 232448  # sm_90's shared memory per block, bytes

# What every build script starts with: ``build(fn, types, consts, options)`` compiles one kernel for sm_90 and
# reads its resource usage with the cuobjdump at argv[2]; the script's JSON cases are argv[1].
SCRIPT_PRELUDE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
cuobjdump = sys.argv[2]


def build(fn, types, consts, options):
    if set(types) | set(consts) != set(fn.arg_names):
        sys.exit(f"test signature out of date with the kernel {fn.arg_names}")
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if m is None:
        sys.exit(f"no resource usage for {fn.__name__}:\n{usage}")
    return k, f"shared {k.metadata.shared} reg {m[1]} stack {m[2]} local {m[4]}"
"""


def assert_sm90_builds_fit(script: str, cases: list[list[Any]]) -> list[str]:
    """Run ``SCRIPT_PRELUDE`` + ``script`` (argv: the JSON ``cases``, cuobjdump's path; one "COMPILED ... shared N
    reg N stack N local N" line per case, as ``build`` returns them) without TRITON_INTERPRET and check every
    build's resource usage; skip without the tools. Returns the COMPILED lines."""
    import triton

    root = os.path.dirname(triton.__file__)
    ptxas, cuobjdump = (os.path.join(root, "backends", "nvidia", "bin", n) for n in ("ptxas", "cuobjdump"))
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        pytest.skip("no ptxas bundled with triton")
    cuobjdump = cuobjdump if os.path.exists(cuobjdump) else shutil.which("cuobjdump") or ""
    if not cuobjdump:
        pytest.skip("no cuobjdump bundled with triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT_PRELUDE + script, json.dumps(cases), cuobjdump], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COMPILED")]
    assert len(lines) == len(cases), proc.stdout
    for line in lines:
        usage = dict(re.findall(r"(shared|reg|stack|local) (\d+)", line))
        assert int(usage["shared"]) <= SHARED_MAX and int(usage["reg"]) <= 255, line
        assert usage["stack"] == usage["local"] == "0", f"spills: {line}"
    return lines
