"""The C kernels' linear products on the bundled SmolLM2's four shapes, timed per ISA build and path beside
torch's own products of the same float32 weights: float32 products, bfloat16 products (AVX-512 BF16's
``vdpbf16ps``, or FMAs on rounded values without it), and, where the CPU has Intel AMX, bfloat16 products on
AMX tiles; ``F.linear`` (MKL) and oneDNN's packed weight as torch runs them. Weights in the bundled model's
format (GGUF Q4_1 blocks) or as bfloat16 pairs; random values.

    .venv/bin/python benchmarks/bench_linear.py                        # every ISA build this CPU runs
    .venv/bin/python benchmarks/bench_linear.py --isa avx2 --rows 64 256 --threads 1 --out results/linear.json
    .venv/bin/python benchmarks/bench_linear.py --rows 1 2 4 8 --layers 30   # weights streamed, as in a decode step

Prints the CPU, the build, its measured FMA peak and copy bandwidth, then one row per (row count, path):
milliseconds for the four products of one decoder layer, GFLOP/s, each path's speed against the C kernels'
float32 products (and, at 1-4 rows, the same products on the tiled path instead of the few-row one: "f32
tiled"), the float32 products' share of the FMA peak, and at one row their share of the memory roofline (the
weights' bytes over the copy bandwidth). Min of --repeats."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from cpu_info import copy_bandwidth_gbs, describe, fma_peak_gflops
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cbserve.worker.cpu.gguf_blocks import QuantBlocks
from cbserve.worker.cpu.kernels import CpuKernels, Panels
from cbserve.worker.cpu.linear import pack_weight as pack_onednn
from cbserve.worker.cpu.linear import packed_linear, packing_supported
from cbserve.worker.cpu.native import load_cpu_kernels, supported_levels

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


Layers = list[dict[str, dict[str, Panels]]]  # per layer: each shape's packings


def torch_products(kernels: CpuKernels, layers: Layers) -> dict[str, Callable]:
    """torch's products of the same float32 weights: ``F.linear`` and, where torch has it, oneDNN's packing."""
    dense = [{name: kernels.unpack(w[name]["f32"]) for name in SHAPES} for w in layers]
    paths: dict[str, Callable] = {"torch F.linear": lambda layer, name, x: F.linear(x, dense[layer][name])}
    if all(packing_supported(w) for w in dense[0].values()):
        packed = [{name: pack_onednn(w) for name, w in d.items()} for d in dense]
        paths["torch onednn"] = lambda layer, name, x: packed_linear(x, packed[layer][name], None)
    return paths


def time_layer(product: Callable[[int, str, torch.Tensor], object], rows: int, repeats: int, layers: int) -> float:
    """Min seconds of the four products of one layer at ``rows`` rows, over ``layers`` layers' weights in turn."""
    xs = {name: torch.randn(rows, k) for name, (_, k) in SHAPES.items()}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for layer in range(layers):
                for name in SHAPES:
                    product(layer, name, xs[name])
            best = min(best, (time.perf_counter() - t0) / layers)
    return best


def layer_flops(rows: int) -> float:
    return 2.0 * rows * sum(n * k for n, k in SHAPES.values())


def _paths(kernels: CpuKernels, layers: Layers, has_amx: bool) -> dict[str, tuple]:
    """path -> (product, AMX on, few-row path on): the C kernels' paths, then torch's. "f32 tiled": the float32
    products with the few-row path (csrc/rows.c, steps of up to 4 rows) off, the tiled path bigger steps take."""
    bf16 = "bf16 avx512" if "avx512_bf16" in kernels.isa_features else "bf16 fma"
    f32 = lambda layer, name, x: kernels.linear(x, layers[layer][name]["f32"], None)  # noqa: E731
    paths: dict[str, tuple] = {"f32": (f32, False, True), "f32 tiled": (f32, False, False),
                               bf16: (lambda layer, name, x: kernels.linear(x, layers[layer][name]["bf16"], None),
                                      False, True)}
    if has_amx:
        paths["bf16 amx"] = (paths[bf16][0], True, True)
    return paths | {name: (fn, False, True) for name, fn in torch_products(kernels, layers).items()}


def measure(kernels: CpuKernels, fmt: str, rows_list: list[int], repeats: int, peak_gflops: float | None = None,
            roofline_ms: float | None = None, layers: int = 1) -> list[dict[str, object]]:
    """One row per (row count, path); ``peak_gflops``: the f32 rows' share of it as "of_peak";
    ``roofline_ms`` (one row's weight bytes over the copy bandwidth): the one-row f32 share as "of_roofline".
    ``layers``: distinct copies of the weights, multiplied in turn (30, SmolLM2's: they stream from memory, as
    in a real step, instead of staying in cache)."""
    weights = [packed_weights(kernels, fmt, seed=layer) for layer in range(layers)]
    has_amx = kernels.set_amx(True)
    paths, results = _paths(kernels, weights, has_amx), []
    for rows in rows_list:
        time_layer(paths["f32"][0], rows, 1, layers)  # warm-up: pages, caches
        secs = {}
        for path, (product, amx, few_rows) in paths.items():
            if path == "f32 tiled" and rows > 4:
                continue  # the same path as "f32" there
            kernels.set_amx(amx)
            kernels.set_rows(few_rows)
            secs[path] = time_layer(product, rows, repeats, layers)
        for path, s in secs.items():
            row = {"rows": rows, "path": path, "ms": 1e3 * s, "gflops": layer_flops(rows) / s / 1e9,
                   "vs_f32": secs["f32"] / s}
            if path == "f32" and peak_gflops:
                row["of_peak"] = row["gflops"] / peak_gflops
            if path == "f32" and rows == 1 and roofline_ms:
                row["of_roofline"] = roofline_ms / row["ms"]
            results.append(row)
            print(_line(row), flush=True)
    kernels.set_amx(True)
    kernels.set_rows(True)
    return results


def _line(row: dict) -> str:
    extra = f"  {100 * row['of_peak']:3.0f}% of FMA peak" if "of_peak" in row else ""
    extra += f"  {100 * row['of_roofline']:3.0f}% of memory roofline" if "of_roofline" in row else ""
    return (f"{row['rows']:5d} rows  {row['path']:15s} {row['ms']:9.3f} ms  {row['gflops']:7.1f} GFLOP/s  "
            f"{row['vs_f32']:5.2f}x C f32{extra}")


def weight_bytes(weights: dict[str, dict[str, Panels]]) -> int:
    return sum(w["f32"].nbytes for w in weights.values())


def plot(runs: list[dict[str, object]], fmt: str, path: Path) -> None:
    """GFLOP/s against rows, one panel per ISA build: each path, and the build's FMA peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False, sharey=True)
    for ax, run in zip(axes[0], runs, strict=True):
        results = run["results"]
        for path_name in dict.fromkeys(r["path"] for r in results):  # type: ignore[union-attr]
            rows = [r for r in results if r["path"] == path_name]  # type: ignore[union-attr]
            ax.plot([r["rows"] for r in rows], [r["gflops"] for r in rows], marker="o", label=path_name,
                    linestyle="-" if not str(path_name).startswith("torch") else "--")
        if run["fma_peak_gflops"]:
            ax.axhline(run["fma_peak_gflops"], color="grey", linestyle=":", label="FMA peak")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{run['isa']} build", fontsize=10)
        ax.set_xlabel("rows (tokens in the step)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GFLOP/s, SmolLM2's 4 layer products")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{str(runs[0]['cpu']).split(',')[0]}: C kernels ({fmt} weights) vs torch", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_isa(isa: str, args: argparse.Namespace, bandwidth: float) -> dict[str, object] | None:
    load = load_cpu_kernels(isa)
    if load.kernels is None:
        print(f"bench_linear: no {isa} C kernels on this machine: {load.reason}", file=sys.stderr)
        return None
    kernels = load.kernels
    peak = fma_peak_gflops(isa, torch.get_num_threads())
    roofline_ms = 1e3 * weight_bytes(packed_weights(kernels, args.format)) / (bandwidth * 1e9)
    amx = kernels.set_amx(True)
    print(f"\n{describe(isa)}: {args.format} weights, AMX {'on' if amx else 'not available'}, FMA peak "
          f"{peak or float('nan'):.1f} GFLOP/s, copy bandwidth {bandwidth:.1f} GB/s")
    results = measure(kernels, args.format, args.rows, args.repeats, peak, roofline_ms, args.layers)
    return {"isa": isa, "cpu": describe(isa), "amx": amx, "fma_peak_gflops": peak, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 2048])
    ap.add_argument("--format", choices=["Q4_1", "bf16"], default="Q4_1", help="the weights' storage")
    ap.add_argument("--isa", nargs="+", choices=["avx512", "avx2", "scalar"], default=None,
                    help="the builds to time (default: every level this CPU runs)")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=1,
                    help="distinct copies of the layer's weights, multiplied in turn (30: SmolLM2's whole stack, "
                         "streamed from memory as a decode step reads it; 1: one layer's, in cache)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here, and a plot beside it")
    args = ap.parse_args()
    if min(args.rows) < 1 or args.repeats < 1 or args.layers < 1:
        ap.error("--rows, --repeats and --layers must be at least 1")
    levels = args.isa or list(supported_levels())
    if unknown := set(levels) - set(supported_levels()):
        ap.error(f"this CPU does not run {sorted(unknown)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth_gbs()
    runs = [r for r in (run_isa(isa, args, bandwidth) for isa in levels) if r is not None]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"format": args.format, "threads": torch.get_num_threads(),
                                        "layers": args.layers, "copy_bandwidth_gbs": bandwidth, "runs": runs},
                                       indent=1))
        plot(runs, args.format, args.out.with_suffix(".png"))
    return 0 if runs else 2


if __name__ == "__main__":
    sys.exit(main())
