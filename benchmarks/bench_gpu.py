"""GPU benchmark: cbserve in-process vs HF transformers' continuous batching, plus rooflines.

Model: Llama-3-8B-shaped (32 layers, hidden 4096, GQA 32/8, vocab 128256) with random bf16 weights built
here (nothing is downloaded): the config is written to a temp folder and cbserve's weight iterator is
replaced by a seeded random generator; HF gets the very same tensors.

Workload (defaults): 512 requests, 512-token random prompts, output lengths uniform in [128, 512],
ignore_eos, all submitted at once (burst). Measured:
  1. end-to-end output tok/s for cbserve (EngineCore + LocalExecutor) and HF ``generate``'s
     continuous-batching manager, on the same GPU, one after the other;
  2. cbserve decode-step time (forward + LM head) at batch 64/128/256 against the HBM roofline:
     (weight bytes + KV bytes read) / measured device-copy bandwidth;
  3. a prefill step against the matmul roofline: FLOPs / measured bf16 GEMM throughput;
  4. decode step time with CUDA graphs on vs off at small batch.
Prints a table and writes ``bench_gpu.png`` + ``bench_gpu.json`` to ``--out-dir``. cbserve runs as served:
decode steps replay CUDA graphs unless ``--enforce-eager``. The workload and end-to-end runs are in
``gpu_workload.py``, the step measurements in ``gpu_rooflines.py``.

    python benchmarks/bench_gpu.py                        # H100/H200, ~5 min
    python benchmarks/bench_gpu.py --preset tiny --device cpu --num-requests 8 --prompt-len 32 \\
        --min-out 4 --max-out 8 --decode-batches 2 4 --graph-batches 1 --skip-hf   # plumbing smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from gpu_rooflines import copy_bandwidth, decode_rooflines, graphs_on_off, matmul_flops, prefill_roofline
from gpu_workload import PRESETS, build_cbserve, make_workload, run_cbserve_e2e, run_hf_e2e, write_model_folder


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--min-out", type=int, default=128)
    p.add_argument("--max-out", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (ModelConfig.enforce_eager)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--decode-context", type=int, default=1024, help="context length per request")
    p.add_argument("--graph-batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_results")
    return p.parse_args()



def report(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_gpu.json").write_text(json.dumps(results, indent=2))
    print(f"\ndevice: {results['device']}  copy bandwidth {results['copy_gb_s']:.0f} GB/s  "
          f"bf16 GEMM {results['gemm_tflops']:.0f} TFLOP/s  backend {results['backend']}")
    for name in ("cbserve", "hf"):
        r = results.get(name)
        if isinstance(r, dict):
            print(f"{name:8s} e2e: {r['output_tok_s']:9.0f} out tok/s  {r['total_tok_s']:9.0f} total tok/s  "
                  f"{r['seconds']:7.1f} s")
        elif r:
            print(f"{name:8s} e2e: {r}")
    print(f"\n{'batch':>6} {'ctx':>6} {'step ms':>9} {'roofline':>9} {'eff':>6} {'tok/s':>9}")
    for r in results["decode"]:
        print(f"{r['batch']:>6} {r['context']:>6} {r['step_ms']:>9.2f} {r['roofline_ms']:>9.2f} "
              f"{r['efficiency']:>6.0%} {r['tok_s']:>9.0f}")
    p = results["prefill"]
    print(f"prefill {p['tokens']} tokens: {p['step_ms']:.1f} ms (matmul roofline {p['roofline_ms']:.1f} ms, "
          f"{p['efficiency']:.0%}, {p['tflops']:.0f} TFLOP/s)")
    for r in results["graphs"]:
        print(f"graphs batch {r['batch']:>4}: eager {r['eager_ms']:.2f} ms, graph {r['graph_ms']:.2f} ms "
              f"({r['speedup']:.2f}x)")
    _plot(results, out_dir / "bench_gpu.png")


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [n for n in ("cbserve", "hf") if isinstance(results.get(n), dict)]
    axes[0].bar(names, [results[n]["output_tok_s"] for n in names], color=["C0", "C1"][: len(names)])
    axes[0].set(title="end-to-end output throughput", ylabel="tokens / s")
    dec = results["decode"]
    axes[1].plot([r["batch"] for r in dec], [r["step_ms"] for r in dec], "o-", label="measured")
    axes[1].plot([r["batch"] for r in dec], [r["roofline_ms"] for r in dec], "s--", label="HBM roofline")
    axes[1].set(title="decode step (forward + LM head)", xlabel="batch", ylabel="ms")
    axes[1].legend()
    g = results["graphs"]
    if g:
        x = range(len(g))
        axes[2].bar([i - 0.2 for i in x], [r["eager_ms"] for r in g], 0.4, label="eager")
        axes[2].bar([i + 0.2 for i in x], [r["graph_ms"] for r in g], 0.4, label="CUDA graph")
        axes[2].set_xticks(list(x), [str(r["batch"]) for r in g])
        axes[2].legend()
    axes[2].set(title="decode step, CUDA graphs", xlabel="batch", ylabel="ms")
    fig.suptitle(f"{results['preset']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {"preset": args.preset, "args": vars(args), "device": name}
    bw, flops = copy_bandwidth(device), matmul_flops(device)
    results.update(copy_gb_s=bw / 1e9, gemm_tflops=flops / 1e12)
    with tempfile.TemporaryDirectory(prefix="cbserve-bench-") as tmp:
        cfg = write_model_folder(args.preset, Path(tmp))
        prompts, outs = make_workload(args, cfg.vocab_size)
        executor = build_cbserve(args, Path(tmp), cfg, device)
        runner = executor.runner
        results["backend"] = runner.backend_cls.name
        results["num_blocks"] = executor.num_blocks
        results["decode"] = decode_rooflines(args, runner, bw)
        results["prefill"] = prefill_roofline(args, runner, flops)
        results["graphs"] = graphs_on_off(args, runner)
        if not args.skip_e2e:
            results["cbserve"] = run_cbserve_e2e(args, executor, prompts, outs)
        executor.shutdown()
        del executor, runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.skip_hf and not args.skip_e2e:
            try:
                results["hf"] = run_hf_e2e(args, cfg, device, prompts, outs)
            except Exception as e:  # report, keep cbserve's numbers
                results["hf"] = f"failed: {type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            gc.collect()
    report(results, Path(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
