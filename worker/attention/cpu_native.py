"""Build, cache and call the C kernels of ``cpu_kernels.c`` (paged decode attention for CPUs).

The source is compiled once per machine with the system C compiler (``$CC``, else gcc, else cc) at
``-O3 -march=native -fopenmp`` into ``$CBSERVE_KERNEL_CACHE`` (default ``~/.cache/cbserve/kernels``), in
well under a second; the file name carries a hash of the source, the flags, the compiler and the CPU, so
a changed kernel or another machine sharing the folder builds its own copy. The library links
``libgomp.so.1``, which resolves to the one torch has already loaded: the kernel runs on torch's OpenMP
threads and honours ``torch.set_num_threads``. It is called through ctypes, which releases the GIL.

No compiler, a failed build, or ``CBSERVE_CPU_KERNELS=0`` leave the kernels unavailable; the attention
selector then uses the torch backend and logs why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
               "-fassociative-math")
# Tried in order: the first set the compiler accepts is used (no -march=native on an unusual target, no
# OpenMP where the compiler lacks it: the kernel then runs on one thread).
_FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
_ERRORS = {1: "out of memory for the kernel's scratch buffers", 2: "invalid shapes",
           3: "a sequence length or block id outside the KV cache"}

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_DECODE_ARGTYPES = [_P, _I64, _P, _I64, _P, _P, _I32, _P, _I64, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32]


@dataclass(frozen=True)
class KernelLoad:
    """The outcome of loading: ``kernels`` is None when unavailable, and ``reason`` says why."""

    kernels: CpuKernels | None
    reason: str


class CpuKernels:
    """ctypes bindings of the compiled library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._decode = self._lib.cb_paged_decode_f32
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = _DECODE_ARGTYPES

    def paged_decode(
        self,
        q: torch.Tensor,  # [n, num_heads, head_dim] float32, heads contiguous within a row
        out: torch.Tensor,  # [n, num_heads, head_dim] float32, heads contiguous within a row
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32, contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [n, max_blocks] int32, rows contiguous
        seq_lens: torch.Tensor,  # [n] int32, contiguous
        max_seq_len: int,
        scale: float,
    ) -> None:
        """Attention of one query token per sequence over its cached keys/values; writes ``out``."""
        n, heads, dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        _check_rows(q, "q")
        _check_rows(out, "out")
        if out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[3] != dim:
            raise ValueError(f"shape mismatch: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                             f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache must be contiguous")
        if any(t.dtype != torch.float32 for t in (q, out, k_cache, v_cache)):
            raise ValueError("the CPU decode kernel takes float32 tensors")
        if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            raise ValueError("block_tables and seq_lens must be int32 (seq_lens contiguous)")
        if block_tables.shape[0] != n or seq_lens.shape != (n,) or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                             f"do not match {n} sequences")
        if max_seq_len > block_tables.shape[1] * block_size:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table ({block_tables.shape[1]} blocks)")
        if n == 0:
            return
        rc = self._decode(
            q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            num_blocks, block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), n, heads, kv_heads,
            dim, block_size, scale, max_seq_len,
        )
        if rc != 0:
            raise RuntimeError(f"CPU paged decode kernel failed: {_ERRORS.get(rc, f'error {rc}')}")


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU [n, heads, dim] tensor with each row's heads contiguous")


def kernel_cache_dir() -> Path:
    env = os.environ.get("CBSERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cbserve" / "kernels"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return shutil.which("gcc") or shutil.which("cc")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _library_path(cc: str, flags: tuple[str, ...]) -> Path:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), " ".join(flags).encode(), _cpu_id().encode()):
        h.update(part)
    return kernel_cache_dir() / f"cpu_kernels-{h.hexdigest()[:16]}.so"


def _compile(cc: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into ``target`` (atomically: concurrent builders each write a temporary file and the last
    rename wins); returns the compiler's complaint on failure, None on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip()[-500:] or f"exit status {proc.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> KernelLoad:
    if os.environ.get("CBSERVE_CPU_KERNELS", "1") == "0":
        return KernelLoad(None, "disabled by CBSERVE_CPU_KERNELS=0")
    cc = _compiler()
    if cc is None:
        return KernelLoad(None, "no C compiler found (set CC or install gcc)")
    complaints = []
    for extra in _FLAG_SETS:
        flags = (*_BASE_FLAGS, *extra)
        path = _library_path(cc, flags)
        if not path.exists():
            complaint = _compile(cc, flags, path)
            if complaint is not None:
                complaints.append(f"{' '.join(extra) or 'plain'}: {complaint}")
                continue
            logger.info("built the CPU attention kernels with %s %s -> %s", cc, " ".join(flags), path)
        return KernelLoad(CpuKernels(path), f"loaded {path}")
    return KernelLoad(None, "compiling cpu_kernels.c failed: " + " | ".join(complaints))


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> KernelLoad:
    """Build (first time on this machine) and load the kernels; the result is kept for the process."""
    try:
        return _build()
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache folder, compiler crash, bad .so
        return KernelLoad(None, f"{type(e).__name__}: {e}")
