"""What CPU a benchmark ran on, and its ceilings: the model name and ISA level (named in every figure), the
measured FMA peak (an unrolled loop of independent FMAs, compiled here for the level's vector width) and the
measured memory bandwidths: torch's copy (bytes read + written) and a read-only stream (what a decode step
does with the weights)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import torch

from cbserve.bench.report import cpu_model
from cbserve.worker.cpu import native

# A timed main: @BODY@, run by every OpenMP thread, does ``iters`` iterations of @FLOPS@ floating-point operations
# each; the best of 3 runs' GFLOP/s over all threads is printed.
_TIMED_PEAK = r"""
#include <stdio.h>
#include <time.h>
#include <omp.h>
@HEADERS@
int main(void) {
    const long iters = 20000000;
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
#pragma omp parallel
        {
@BODY@
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
        const double gf = omp_get_max_threads() * iters * (@FLOPS@) / s / 1e9;
        best = gf > best ? gf : best;
    }
    printf("%f\n", best);
    return 0;
}
"""
_FMA_BODY = r"""
            volatile float one = 1.0f; /* not a constant: a * 1.0f + y must stay an FMA, not fold to an add */
            const vf x = (vf){0} + one, y = (vf){0} + 1e-9f;
            vf a0 = x, a1 = x + 1, a2 = x + 2, a3 = x + 3, a4 = x + 4, a5 = x + 5, a6 = x + 6, a7 = x + 7,
               a8 = x + 8, a9 = x + 9, a10 = x + 10, a11 = x + 11;
            for (long it = 0; it < iters; ++it) {
                a0 = a0 * x + y; a1 = a1 * x + y; a2 = a2 * x + y; a3 = a3 * x + y; a4 = a4 * x + y;
                a5 = a5 * x + y; a6 = a6 * x + y; a7 = a7 * x + y; a8 = a8 * x + y; a9 = a9 * x + y;
                a10 = a10 * x + y; a11 = a11 * x + y;
                __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6),
                                 "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
            }
            const vf a = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
            volatile float sink = a[0];
            (void)sink;
"""
_BF16_BODY = r"""
            volatile int bits = 0x3f803f80; /* a pair of bfloat16 ones, not a constant */
            const __m512bh x = (__m512bh)_mm512_set1_epi32(bits);
            __m512 a0 = _mm512_set1_ps(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,
                   a8 = a0, a9 = a0, a10 = a0, a11 = a0;
            for (long it = 0; it < iters; ++it) {
                a0 = _mm512_dpbf16_ps(a0, x, x); a1 = _mm512_dpbf16_ps(a1, x, x); a2 = _mm512_dpbf16_ps(a2, x, x);
                a3 = _mm512_dpbf16_ps(a3, x, x); a4 = _mm512_dpbf16_ps(a4, x, x); a5 = _mm512_dpbf16_ps(a5, x, x);
                a6 = _mm512_dpbf16_ps(a6, x, x); a7 = _mm512_dpbf16_ps(a7, x, x); a8 = _mm512_dpbf16_ps(a8, x, x);
                a9 = _mm512_dpbf16_ps(a9, x, x); a10 = _mm512_dpbf16_ps(a10, x, x);
                a11 = _mm512_dpbf16_ps(a11, x, x);
                __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),
                                 "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
            }
            volatile float sink = _mm512_reduce_add_ps(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11);
            (void)sink;
"""


def _timed_peak(headers: str, body: str, flops: str) -> str:
    return _TIMED_PEAK.replace("@HEADERS@", headers).replace("@BODY@", body).replace("@FLOPS@", flops)


# 12 independent FMAs of VW lanes an iteration; 12 vdpbf16ps of 32 products and their sums
_PEAK_SRC = _timed_peak("typedef float vf __attribute__((vector_size(VW * 4)));", _FMA_BODY, "12.0 * VW * 2")
_BF16_PEAK_SRC = _timed_peak("#include <immintrin.h>", _BF16_BODY, "12.0 * 64")
_READ_SRC = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
typedef float vf __attribute__((vector_size(VW * 4)));
int main(void) {
    const long n = 1L << 28; /* 1 GiB of floats, far beyond the caches */
    float *a = aligned_alloc(1L << 21, n * 4);
#ifdef MADV_HUGEPAGE
    madvise(a, n * 4, MADV_HUGEPAGE); /* as torch's allocator asks for a model's weights */
#endif
#pragma omp parallel for
    for (long i = 0; i < n; ++i) a[i] = 1.0f;
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        float total = 0;
#pragma omp parallel reduction(+ : total)
        {
            vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
#pragma omp for
            for (long i = 0; i < n; i += 4 * VW) {
                s0 += *(const vf *)(a + i); s1 += *(const vf *)(a + i + VW);
                s2 += *(const vf *)(a + i + 2 * VW); s3 += *(const vf *)(a + i + 3 * VW);
            }
            const vf s = s0 + s1 + s2 + s3;
            for (int j = 0; j < VW; ++j) total += s[j];
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double gbs = n * 4.0 / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec)) / 1e9;
        best = gbs > best && total > 0 ? gbs : best;
    }
    printf("%f\n", best);
    return 0;
}
"""
_MARCH = {"avx512": ("-march=native", "-DVW=16"), "avx2": ("-march=x86-64-v3", "-DVW=8"),
          "scalar": ("-march=x86-64", "-DVW=4")}


def describe(isa: str) -> str:
    """e.g. 'AMD EPYC 7B13, avx2 build (CPU runs avx2, scalar), 2 threads'."""
    return (f"{cpu_model()}, {isa} build (CPU runs {', '.join(native.supported_levels())}), "
            f"{torch.get_num_threads()} threads")


def fma_peak_gflops(isa: str, threads: int) -> float | None:
    """float32 GFLOP/s of ``threads`` threads doing nothing but independent FMAs of the level's width (None
    without a compiler)."""
    return _run_c(_PEAK_SRC, isa, threads)


def bf16_dot_peak_gflops(threads: int) -> float | None:
    """GFLOP/s of ``threads`` threads doing nothing but independent AVX512-BF16 ``vdpbf16ps`` (each 32 products
    and their sums; None without a compiler or where this CPU has no AVX512-BF16)."""
    if "avx512" not in native.supported_levels():
        return None
    return _run_c(_BF16_PEAK_SRC, "avx512", threads)


def read_bandwidth_gbs(isa: str, threads: int) -> float | None:
    """Bytes per second ``threads`` threads read summing a 1 GiB buffer with the level's vectors, best of 5: the
    rate a decode step could stream its weights at (None without a compiler). The buffer asks for transparent
    huge pages, as torch's allocator does for tensors this large (the weights): on a virtual machine 4 KiB pages
    can cost a third of the rate in address translation (measured on a 2-core EPYC VM: 43 against 65 GB/s)."""
    return _run_c(_READ_SRC, isa, threads)


def _run_c(source: str, isa: str, threads: int) -> float | None:
    """Compile ``source`` for ``isa`` and run it on ``threads`` OpenMP threads: the number it prints."""
    cc = native._compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(source)
        flags = (*_MARCH[isa], "-O2", "-fopenmp") if native._is_x86() else ("-DVW=4", "-O2", "-fopenmp")
        if subprocess.run([cc, *flags, str(src), "-o", str(exe)], capture_output=True).returncode != 0:
            return None
        out = subprocess.run([str(exe)], capture_output=True, text=True, env={"OMP_NUM_THREADS": str(threads)})
        return float(out.stdout.strip()) if out.returncode == 0 else None


def copy_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Bytes read + written per second copying a buffer far larger than the caches (torch's copy)."""
    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9
