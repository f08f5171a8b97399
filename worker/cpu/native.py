"""Build, cache and load cbserve's CPU kernels: the C sources in ``csrc/`` (decode attention, the packed-panel
linear layers, RMSNorm, SiLU-and-mul, rotary, the one-call layer driver) compiled into one shared library
whose exports are exactly the ``CB_API`` functions of ``csrc/cb_cpu.h`` (``-fvisibility=hidden``).

The sources are compiled once per machine with the system C compiler (``$CC``, else gcc, else cc) at
``-O3 -march=native -fopenmp`` into ``$CBSERVE_KERNEL_CACHE`` (default ``~/.cache/cbserve/kernels``), in
about a second; the file name carries a hash of the sources, the flags, the compiler and the CPU, so a
changed kernel or another machine sharing the folder builds its own copy. The library links
``libgomp.so.1``, which resolves to the one torch has already loaded: the kernels run on torch's OpenMP
threads and honour ``torch.set_num_threads``. They are called through ctypes (``kernels.py``, bound by
``abi.py``, which checks its table against the header first), which releases the GIL.

No compiler, a failed build, or ``CBSERVE_CPU_KERNELS=0`` leave the kernels unavailable; the model runner
then uses torch (and oneDNN) for everything and logs why.
"""

from __future__ import annotations

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

from .kernels import CpuKernels

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-math-errno", "-fno-trapping-math",
               "-fno-signed-zeros", "-fassociative-math")
# Tried in order: the first set the compiler accepts is used (no -march=native on an unusual target, no
# OpenMP where the compiler lacks it: the kernels then run on one thread).
_FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())


@dataclass(frozen=True)
class KernelLoad:
    """The outcome of loading: ``kernels`` is None when unavailable, and ``reason`` says why."""

    kernels: CpuKernels | None
    reason: str


def sources() -> list[Path]:
    """The C files compiled into the library, and the headers they include (both go into its hash, so a
    changed header, cb_cpu.h included, builds a new library)."""
    return sorted(SOURCE_DIR.glob("*.c")) + sorted(SOURCE_DIR.glob("*.h"))


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
    for src in sources():
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    for part in (cc.encode(), " ".join(flags).encode(), _cpu_id().encode()):
        h.update(part)
    return kernel_cache_dir() / f"cpu_kernels-{h.hexdigest()[:16]}.so"


def _compile(cc: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into ``target`` (atomically: concurrent builders each write a temporary file and the last
    rename wins); returns the compiler's complaint on failure, None on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        c_files = [str(p) for p in sources() if p.suffix == ".c"]
        proc = subprocess.run([cc, *flags, *c_files, "-lm", "-o", tmp], capture_output=True, text=True, timeout=300)
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
            logger.info("built the CPU kernels with %s %s -> %s", cc, " ".join(flags), path)
        return KernelLoad(CpuKernels(path, SOURCE_DIR / "cb_cpu.h"), f"loaded {path}")
    return KernelLoad(None, "compiling the CPU kernels failed: " + " | ".join(complaints))


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> KernelLoad:
    """Build (first time on this machine) and load the kernels; the result is kept for the process."""
    try:
        return _build()
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache folder, compiler crash, bad .so
        return KernelLoad(None, f"{type(e).__name__}: {e}")
