"""The C kernels' linear products on the bundled SmolLM2's four shapes, timed per path: float32 products,
bfloat16 products on AVX-512 BF16 (``vdpbf16ps``), and, where the CPU has Intel AMX, bfloat16 products on AMX
tiles. Weights in the bundled model's format (GGUF Q4_1 blocks) or as bfloat16 pairs; random values.

    .venv/bin/python benchmarks/bench_linear.py                        # rows 1..2048, the machine's threads
    .venv/bin/python benchmarks/bench_linear.py --rows 64 256 --threads 1 --out /tmp/linear.json

Prints one row per (row count, path): milliseconds for the four products of one decoder layer, TFLOP/s, and
each path's speed against the float32 products (and AMX's against AVX-512 BF16's). Min of --repeats."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from cbserve.worker.cpu.gguf_blocks import QuantBlocks
from cbserve.worker.cpu.kernels import CpuKernels, Panels
from cbserve.worker.cpu.native import load_cpu_kernels
from gguf import GGMLQuantizationType
from gguf.quants import quantize

# SmolLM2-135M: hidden 576, 9 query heads and 3 kv heads of 64, intermediate 1536: (n, k) of each product.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def packed_weights(kernels: CpuKernels, fmt: str, seed: int = 0) -> dict[str, dict[str, Panels]]:
    """Each shape's weight packed for float32 products ("f32") and for bfloat16 products ("bf16")."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, Panels]] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        if fmt == "Q4_1":
            blocks = QuantBlocks(fmt, torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_1)))
            f32 = kernels.pack_q4_1(*blocks.q4_1())
            out[name] = {"f32": f32, "bf16": kernels.with_bf16_products(f32)}
        else:
            out[name] = {"f32": kernels.pack_weight(w, "f32"), "bf16": kernels.pack_weight(w, "bf16_dot")}
    return out


def time_layer(kernels: CpuKernels, weights: dict[str, dict[str, Panels]], kind: str, rows: int,
               repeats: int) -> float:
    """Min seconds of the four products of one layer at ``rows`` rows, ``kind`` panels."""
    xs = {name: torch.randn(rows, k) for name, (_, k) in SHAPES.items()}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for name in SHAPES:
            kernels.linear(xs[name], weights[name][kind], None)
        best = min(best, time.perf_counter() - t0)
    return best


def layer_flops(rows: int) -> float:
    return 2.0 * rows * sum(n * k for n, k in SHAPES.values())


def measure(kernels: CpuKernels, fmt: str, rows_list: list[int], repeats: int) -> list[dict[str, object]]:
    weights = packed_weights(kernels, fmt)
    has_amx = kernels.set_amx(True)
    results = []
    for rows in rows_list:
        time_layer(kernels, weights, "f32", rows, 1)  # warm-up: pages, caches
        paths = {"f32": ("f32", False), "bf16 avx512": ("bf16", False)}
        if has_amx:
            paths["bf16 amx"] = ("bf16", True)
        secs = {}
        for path, (kind, amx) in paths.items():
            kernels.set_amx(amx)
            secs[path] = time_layer(kernels, weights, kind, rows, repeats)
        for path, s in secs.items():
            row = {"rows": rows, "path": path, "ms": 1e3 * s, "tflops": layer_flops(rows) / s / 1e12,
                   "vs_f32": secs["f32"] / s}
            if path == "bf16 amx":
                row["vs_avx512_bf16"] = secs["bf16 avx512"] / s
            results.append(row)
            extra = f"  {row['vs_avx512_bf16']:.2f}x AVX-512 BF16" if "vs_avx512_bf16" in row else ""
            print(f"{rows:5d} rows  {path:12s} {row['ms']:9.3f} ms  {row['tflops']:6.3f} TF/s  "
                  f"{row['vs_f32']:5.2f}x f32{extra}", flush=True)
    kernels.set_amx(True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 2048])
    ap.add_argument("--format", choices=["Q4_1", "bf16"], default="Q4_1", help="the weights' storage")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if min(args.rows) < 1 or args.repeats < 1:
        ap.error("--rows and --repeats must be at least 1")
    load = load_cpu_kernels()
    if load.kernels is None:
        print(f"bench_linear: no C kernels on this machine: {load.reason}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    amx = load.kernels.set_amx(True)
    print(f"{args.format} weights, {torch.get_num_threads()} threads, AMX {'on' if amx else 'not available'}")
    results = measure(load.kernels, args.format, args.rows, args.repeats)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"format": args.format, "threads": torch.get_num_threads(),
                                        "amx": amx, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
