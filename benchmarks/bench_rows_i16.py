"""Products on int16 rows (csrc/rows_i16.c: the ``*_i16`` panel formats' few rows, the ``*_i16all`` formats' any number
of rows, cpu_prefill_activations "int16") against float32 rows (csrc/rows.c; more rows: the tiled path), through
Llama-3.2-1B's four linear products (hidden 2048, MLP 8192, 32 query / 8 kv heads of 64): qkv 2048 -> 3072, o 2048
-> 2048, gate_up 2048 -> 16384, down 8192 -> 2048. Random GGUF blocks (Q4_0, Q4_K, Q6_K, Q8_0), ``--copies`` copies of
the layer's weights multiplied in turn so they stream from memory as a decode step's do. ``--formats BF16``: the same
products on bfloat16 weights (``--dtype bfloat16``: "bf16_dot" panels, AVX512-BF16's ``vdpbf16ps``) against float32
panels of the same values, their GFLOP/s also against the measured ``vdpbf16ps`` peak.

    .venv/bin/python benchmarks/bench_rows_i16.py                          # avx512 and avx2 builds, 1, 2, 4 rows
    .venv/bin/python benchmarks/bench_rows_i16.py --isa avx2 --rows 1 --formats Q4_K
    .venv/bin/python benchmarks/bench_rows_i16.py --rows 64 256 --copies 1   # prefill: tiled float32 against i16all
    .venv/bin/python benchmarks/bench_rows_i16.py --in-cache --copies 20     # qkv and o only, one copy: in L3
    .venv/bin/python benchmarks/bench_rows_i16.py --isa avx512 --formats BF16 --rows 1 8 16 32 128 512 --copies 2

Every (ISA, format, rows, rows type) is timed once per round, the rounds interleaved (the machine may be shared:
each figure is the median of --repeats rounds, the best beside it). Prints the CPU, the read bandwidth measured
just before (cpu_info.py: what streaming weights can reach at the time), /proc/loadavg before and after, and per
line GB/s of packed weights streamed, one pass's milliseconds (over all copies), GFLOP/s, its share of the float32
FMA peak measured at the start (cpu_info.py) and int16 / float32."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from cpu_info import bf16_dot_peak_gflops, describe, fma_peak_gflops, read_bandwidth_gbs

from cbserve.worker.cpu.kernels import CpuKernels, Panels
from cbserve.worker.cpu.native import load_cpu_kernels, supported_levels

# Llama-3.2-1B: (n, k) of each product of one decoder layer
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
GGUF_FORMATS = ("Q4_0", "Q4_K", "Q6_K", "Q8_0")
FORMATS = (*GGUF_FORMATS, "BF16")
KINDS = ("f32", "i16", "i16all")  # float32 rows; int16 rows for a few rows only; int16 rows for every row count


def kinds(fmt: str) -> tuple[str, ...]:
    """The packings timed for ``fmt``: BF16's are float32 panels and bfloat16-products panels of the same values."""
    return ("f32", "bf16") if fmt == "BF16" else KINDS


def pack(kernels: CpuKernels, fmt: str, n: int, k: int, gen: torch.Generator) -> Panels:
    """Random blocks of ``fmt`` packed as its panel format (float16 scales, values of the format's range); BF16:
    random bfloat16 values as float32 panels."""
    if fmt == "BF16":
        return kernels.pack_weight((torch.randn(n, k, generator=gen) * 0.05).bfloat16().float(), "f32")
    half = lambda shape: (torch.rand(*shape, generator=gen) * 0.01).half().float()  # noqa: E731
    u8 = lambda top, shape: torch.randint(0, top, shape, dtype=torch.uint8, generator=gen)  # noqa: E731
    if fmt == "Q4_0":
        return kernels.pack_q4_0(half((n, k // 32)), u8(16, (n, k)))
    if fmt == "Q8_0":
        return kernels.pack_q8_0(half((n, k // 32)), torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen))
    if fmt == "Q4_K":
        return kernels.pack_q4_k(half((n, k // 256)), half((n, k // 256)), u8(64, (n, k // 32)),
                                 u8(64, (n, k // 32)), u8(16, (n, k)))
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    return kernels.pack_q6_k(half((n, k // 256)), sc, u8(64, (n, k)))


def layer_copies(kernels: CpuKernels, fmt: str, copies: int, shapes: dict[str, tuple[int, int]], distinct: bool
                 ) -> dict[str, list[dict[str, Panels]]]:
    """"f32", "i16" and "i16all" packings of ``copies`` copies of one layer's weights, each in its own memory where
    ``distinct``, else the same weights ``copies`` times."""
    gen = torch.Generator().manual_seed(0)
    one = {name: pack(kernels, fmt, n, k, gen) for name, (n, k) in shapes.items()}
    f32 = [{name: Panels(p.fmt, p.data.clone(), p.n, p.k) for name, p in one.items()} for _ in range(copies)] \
        if distinct else [one] * copies
    if fmt == "BF16":
        bf16 = [{name: kernels.pack_weight(kernels.unpack(p), "bf16_dot") for name, p in c.items()}
                for c in (f32 if distinct else f32[:1])] * (1 if distinct else copies)
        return {"f32": f32, "bf16": bf16}
    return {"f32": f32} | {kind: [{name: kernels.with_int16_rows(p, kind == "i16all") for name, p in c.items()}
                                  for c in (f32 if distinct else f32[:1])] * (1 if distinct else copies)
                           for kind in KINDS[1:]}


def one_pass(kernels: CpuKernels, layers: list[dict[str, Panels]], xs: dict[str, torch.Tensor]) -> float:
    """Seconds for every product of every copy, in turn."""
    t0 = time.perf_counter()
    for layer in layers:
        for name, panels in layer.items():
            kernels.linear(xs[name], panels, None)
    return time.perf_counter() - t0


def loadavg() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "n/a"


def time_rounds(builds: dict[str, CpuKernels], weights: dict, xs: dict, keys: list[tuple], repeats: int
                ) -> dict[tuple, list[float]]:
    """Seconds of one pass per key (isa, format, rows, rows type), ``repeats`` interleaved rounds after a warm-up."""
    secs: dict[tuple, list[float]] = {key: [] for key in keys}
    with torch.inference_mode():
        for key in keys:  # warm-up: pages, caches
            one_pass(builds[key[0]], weights[key[:2]][key[3]], xs[key[2]])
        for _ in range(repeats):
            for key in keys:
                secs[key].append(one_pass(builds[key[0]], weights[key[:2]][key[3]], xs[key[2]]))
    return secs


def report(secs: dict[tuple, list[float]], weights: dict, flops_per_row: float, peak: float, bf16_peak: float | None
           ) -> None:
    for isa, fmt, m, kind in secs:
        nbytes = sum(p.data.numel() for layer in weights[(isa, fmt)][kind] for p in layer.values())
        rates = [nbytes / s / 1e9 for s in secs[(isa, fmt, m, kind)]]
        med = statistics.median(secs[(isa, fmt, m, kind)])
        line = (f"{isa:7s} {fmt:5s} {m:4d} rows  {kind:4s} rows {statistics.median(rates):6.1f} GB/s (best "
                f"{max(rates):5.1f}) {1e3 * med:8.2f} ms {m * flops_per_row / med / 1e9:7.1f} GFLOP/s "
                f"({m * flops_per_row / med / 1e9 / peak:4.0%} of the FMA peak)")
        if kind == "bf16" and bf16_peak:
            line += f" ({m * flops_per_row / med / 1e9 / bf16_peak:4.0%} of the vdpbf16ps peak)"
        if kind != "f32":
            line += f"  {kind}/f32 {statistics.median(secs[(isa, fmt, m, 'f32')]) / med:5.2f}x"
        print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", nargs="+", choices=["avx512", "avx2", "scalar"], default=None,
                    help="builds to time (default: avx512 and avx2 where the CPU runs them)")
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(GGUF_FORMATS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--copies", type=int, default=6, help="copies of the layer's weights (6: ~200-300 MB)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--in-cache", action="store_true",
                    help="the qkv and o products only (~6-9 MB: in L3), one copy multiplied --copies times: the "
                    "kernels' compute-bound rate")
    args = ap.parse_args()
    levels = args.isa or [lv for lv in ("avx512", "avx2") if lv in supported_levels()]
    builds = {}
    for isa in levels:
        load = load_cpu_kernels(isa)
        if load.kernels is None:
            print(f"bench_rows_i16: no {isa} kernels: {load.reason}", file=sys.stderr)
            return 2
        builds[isa] = load.kernels
    shapes = {name: SHAPES[name] for name in ("qkv", "o")} if args.in_cache else SHAPES
    read = read_bandwidth_gbs(levels[0], torch.get_num_threads()) or float("nan")
    peak = fma_peak_gflops(levels[0], torch.get_num_threads()) or float("nan")
    bf16_peak = bf16_dot_peak_gflops(torch.get_num_threads()) if "BF16" in args.formats else None
    print(f"{describe(levels[0])}; builds {', '.join(levels)}; read bandwidth {read:.1f} GB/s; float32 FMA peak "
          f"{peak:.0f} GFLOP/s" + (f"; vdpbf16ps peak {bf16_peak:.0f} GFLOP/s" if bf16_peak else "")
          + f"; loadavg before: {loadavg()}", flush=True)
    weights = {(isa, fmt): layer_copies(kern, fmt, args.copies, shapes, not args.in_cache)
               for isa, kern in builds.items() for fmt in args.formats}
    gen = torch.Generator().manual_seed(1)
    xs = {m: {name: torch.randn(m, k, generator=gen) for name, (_, k) in shapes.items()} for m in args.rows}
    keys = [(isa, fmt, m, kind) for (isa, fmt) in weights for m in args.rows for kind in kinds(fmt)]
    secs = time_rounds(builds, weights, xs, keys, args.repeats)
    print(f"loadavg after: {loadavg()}; median of {args.repeats} interleaved rounds (and best)")
    report(secs, weights, 2.0 * args.copies * sum(n * k for n, k in shapes.values()), peak, bf16_peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
