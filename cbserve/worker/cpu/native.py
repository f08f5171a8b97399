"""Build, cache and load cbserve's CPU kernels: the C sources in ``csrc/`` (decode attention, the packed-panel
linear layers, RMSNorm, SiLU-and-mul, rotary, the one-call layer driver) compiled into one shared library
whose exports are exactly the ``CB_API`` functions of ``csrc/cb_cpu.h`` (``-fvisibility=hidden``).

One library per ISA level (``ISA_LEVELS``): "avx512" (AVX-512 F/BW/VL/DQ, plus AVX512-BF16 and AMX where
the CPU has them), "avx2" (AVX2 + FMA, x86-64-v3) and "scalar" (the portable C path, no ISA-specific code:
the reference). ``cpu_isa="auto"`` takes the best level the CPU runs (from its feature flags); a lower level
can be forced (an AVX-512 machine runs and benchmarks the AVX2 build natively), a higher one is refused.
The best level is compiled with ``-march=native`` (the CPU's own extensions and tuning), a forced lower one
for that level's architecture (``-march=x86-64-v3``, or baseline ``x86-64``) tuned for this
CPU. The loaded library reports what it was compiled for (``cb_isa_features``), and a build that does not
match its level is refused rather than run.

The sources are compiled once per machine and level with the system C compiler (``$CC``, else gcc, else cc)
at ``-O3 -fopenmp`` into ``$CBSERVE_KERNEL_CACHE`` (default ``~/.cache/cbserve/kernels``), in about a
second; the file name carries a hash of the sources, the flags, the compiler and the CPU, so a changed
kernel or another machine sharing the folder builds its own copy. The library links ``libgomp.so.1``, which
resolves to the one torch has already loaded: the kernels run on torch's OpenMP threads and honour
``torch.set_num_threads``. They are called through ctypes (``kernels.py``, bound by ``abi.py``, which checks
its table against the header first), which releases the GIL.

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

from cbserve.worker.cpu.kernels import CpuKernels

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-math-errno", "-fno-trapping-math",
               "-fno-signed-zeros", "-fassociative-math")

ISA_LEVELS = ("avx512", "avx2", "scalar")  # best first
# The CPU flags (/proc/cpuinfo) each x86 level needs: x86-64-v4's AVX-512 subsets, x86-64-v3's AVX2 set.
_LEVEL_CPU_FLAGS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}),
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2"}),
    "scalar": frozenset(),
}
# The ISA bits (abi.ISA_FEATURES) a level's library must report, and those it must not.
_LEVEL_BITS = {"avx512": ({"avx2", "avx512"}, set()), "avx2": ({"avx2"}, {"avx512"}), "scalar": (set(), {"avx2"})}
# A forced level below the CPU's best: that level's architecture, tuned for this CPU.
# (GCC < 11 and clang < 12 know x86-64-v3 as haswell)
_LEVEL_MARCH = {"avx2": (("-march=x86-64-v3", "-mtune=native"), ("-march=haswell", "-mtune=native")),
                "scalar": (("-march=x86-64", "-mtune=native"),)}


@dataclass(frozen=True)
class KernelLoad:
    """The outcome of loading: ``kernels`` is None when unavailable, and ``reason`` says why; ``isa`` is the
    level asked for ("auto" resolved to the CPU's best)."""

    kernels: CpuKernels | None
    reason: str
    isa: str = ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def supported_levels(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The ISA levels this CPU runs, best first ("scalar" always; x86 levels from the CPU's flags)."""
    flags = cpu_flags() if flags is None else flags
    if not _is_x86():
        return ("scalar",)
    return tuple(level for level in ISA_LEVELS if _LEVEL_CPU_FLAGS[level] <= flags)


def resolve_isa(requested: str, flags: frozenset[str] | None = None) -> str:
    """The level to build: the best the CPU runs for "auto"; ValueError for an unknown level or one the CPU
    cannot run."""
    levels = supported_levels(flags)
    if requested == "auto":
        return levels[0]
    if requested not in ISA_LEVELS:
        raise ValueError(f"cpu_isa must be 'auto' or one of {ISA_LEVELS}, got {requested!r}")
    if requested not in levels:
        raise ValueError(f"cpu_isa={requested!r}: this CPU runs only {', '.join(levels)}")
    return requested


def level_flag_sets(level: str, best: str) -> tuple[tuple[str, ...], ...]:
    """Compiler flags to try in order for ``level`` on a CPU whose best level is ``best``: the first set the
    compiler accepts is used (no -march on an unusual target, no OpenMP where the compiler lacks it: the
    kernels then run on one thread). The library's own report is checked after (``_check_level``)."""
    if level == best:
        arch: tuple[str, ...] = ("-march=native",) if level != "avx2" else ("-march=native", "-mno-avx512f")
        return ((*arch, "-fopenmp"), ("-fopenmp",), ())
    marches = _LEVEL_MARCH[level] if _is_x86() else ((),)
    return tuple((*march, "-fopenmp") for march in marches) + marches


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


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else the platform's processor or machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def _check_level(kernels: CpuKernels, level: str) -> str | None:
    """Why the loaded library does not fit ``level`` (its ISA bits), or None when it does."""
    must, must_not = _LEVEL_BITS[level]
    have = set(kernels.isa_features)
    if must <= have and not must_not & have:
        return None
    return f"the {level} build reports {'+'.join(sorted(have)) or 'no ISA extensions'}"


def _build(isa: str = "auto") -> KernelLoad:
    if os.environ.get("CBSERVE_CPU_KERNELS", "1") == "0":
        return KernelLoad(None, "disabled by CBSERVE_CPU_KERNELS=0", isa)
    cc = _compiler()
    if cc is None:
        return KernelLoad(None, "no C compiler found (set CC or install gcc)", isa)
    level, best = resolve_isa(isa), supported_levels()[0]
    complaints = []
    for extra in level_flag_sets(level, best):
        flags = (*_BASE_FLAGS, *extra)
        path = _library_path(cc, flags)
        if not path.exists():
            complaint = _compile(cc, flags, path)
            if complaint is not None:
                complaints.append(f"{' '.join(extra) or 'plain'}: {complaint}")
                continue
            logger.info("built the %s CPU kernels with %s %s -> %s", level, cc, " ".join(flags), path)
        kernels = CpuKernels(path, SOURCE_DIR / "cb_cpu.h", level)
        mismatch = _check_level(kernels, level)
        if mismatch is None:
            return KernelLoad(kernels, f"loaded {path}", level)
        complaints.append(f"{' '.join(extra) or 'plain'}: {mismatch}")
    return KernelLoad(None, f"compiling the {level} CPU kernels failed: " + " | ".join(complaints), level)


def load_cpu_kernels(isa: str = "auto") -> KernelLoad:
    """Build (first time on this machine) and load the kernels of ISA level ``isa`` ("auto": the CPU's best;
    ValueError for a level the CPU cannot run); the result is kept for the process, one per level."""
    return _load_level(resolve_isa(isa))


@functools.cache
def _load_level(level: str) -> KernelLoad:
    try:
        load = _build(level)
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache folder, compiler crash, bad .so
        return KernelLoad(None, f"{type(e).__name__}: {e}", level)
    if load.kernels is not None:
        logger.info("CPU kernels: the %s build (%s; this CPU runs %s)", load.isa,
                    "+".join(load.kernels.isa_features) or "portable C", ", ".join(supported_levels()))
    return load
