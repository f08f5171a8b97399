"""Micro-benchmark of the C multi-LoRA product (``CpuKernels.lora_add_``, csrc/lora.c) against the torch loop
over adapter groups (two matmuls and an add per group, as ``LoRALinear.apply`` does): one linear layer's
adapters for a mixed batch, per ISA build this CPU runs. Each timing cycles through --layers copies of the
adapters (as a model's layers do, so their weights come from memory, not the cache; --layers 1: from the
cache). Prints microseconds per call (best of --repeats passes over the layers) and the C kernel's GFLOP/s;
asserts nothing. ``--dtype bfloat16``: the adapters stored in bfloat16 and multiplied as bfloat16 products
(``cb_lora_add_bf16``, what ``dtype: bfloat16`` serves on the C kernels); the torch loop stays float32.

    python benchmarks/bench_lora_kernel.py                       # SmolLM2's qkv_proj: 576 -> 960, 3 parts of rank 16
    python benchmarks/bench_lora_kernel.py --in 576 --out 1536 --cmax 32 --threads 1
    python benchmarks/bench_lora_kernel.py --cmax 1536 --layers 4  # rank 512 on a fused q/k/v: 3 x 512 columns
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.lora_segments import LoRASegments


def _best(fn: Callable[[int], object], layers: int, repeats: int) -> float:
    """Microseconds per call of fn(layer), the best pass over all layers."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        times.append((time.perf_counter() - t0) / layers)
    return min(times[1:]) * 1e6


def _case(name: str, rows: list[int], args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    slots = len(rows)
    a = torch.randn(args.layers, slots, args.cmax, args.fan_in, generator=gen)
    bt = torch.randn(args.layers, slots, args.cmax, args.fan_out, generator=gen)
    b = bt.transpose(2, 3).contiguous()  # the torch loop's [slots, out, cols] per layer
    m = sum(rows)
    x, y = torch.randn(m, args.fan_in, generator=gen), torch.zeros(m, args.fan_out)
    bounds, start = [], 0
    for slot, n in enumerate(rows):
        bounds.append((start, n, slot, args.cmax))
        start += n
    segments = LoRASegments.of(torch.tensor(bounds, dtype=torch.int32))
    ak, btk = a.to(args.dtype), bt.to(args.dtype)  # the kernel's slots
    flops = 2 * m * args.cmax * (args.fan_in + args.fan_out)

    def torch_loop(layer: int) -> None:
        for s0, n, slot, cols in bounds:
            y[s0 : s0 + n] += (x[s0 : s0 + n] @ a[layer, slot, :cols].t()) @ b[layer, slot, :, :cols].t()

    line = f"{name:<24} torch loop {_best(torch_loop, args.layers, args.repeats):8.1f} us"
    for level in cpu_native.supported_levels():
        kernels = cpu_native.load_cpu_kernels(level).kernels
        if kernels is None:
            continue
        us = _best(lambda i, k=kernels: k.lora_add_(x, y, ak[i], btk[i], segments), args.layers, args.repeats)
        line += f" | {level} {us:7.1f} us ({flops / us / 1e3:5.1f} GFLOP/s)"
    print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in", dest="fan_in", type=int, default=576)
    p.add_argument("--out", dest="fan_out", type=int, default=960)
    p.add_argument("--cmax", type=int, default=48)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the adapters' slots")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    print(f"in={args.fan_in} out={args.fan_out} cmax={args.cmax} threads={args.threads} layers={args.layers} "
          f"slots={args.dtype}")
    _case("16 segments x 4 rows", [4] * 16, args)
    _case("16 segments x 1 row", [1] * 16, args)
    _case("1 segment x 1 row", [1], args)
    _case("4 segments x 512 rows", [512] * 4, args)
    _case("1 segment x 2048 rows", [2048], args)


if __name__ == "__main__":
    main()
