"""CPU benchmark: one burst workload through HF static batching, HF continuous batching and cbserve.

Workload (defaults): 64 requests, random prompts of 16-128 tokens, output lengths drawn from
{8, 16, 32, 64, 128, 256}, ignore_eos, the bundled SmolLM2-135M-Instruct in fp32, all submitted at once.

  (a) HF transformers ``generate`` in static batches of 16 (left padding; every batch runs until its
      longest member is done, so the useful tokens are the requested ones, not the padded ones);
  (b) HF transformers' continuous batching (``init_continuous_batching``, per-request max_new_tokens);
  (c) cbserve in-process (EngineCore + LocalExecutor) on plain torch (``cpu_ops="torch"``: F.linear on
      MKL, torch attention);
  (d) cbserve with oneDNN-packed linear weights and torch for the rest (``cpu_ops="onednn"``);
  (e) cbserve's C kernels (``cpu_ops="native"``) for the linear layers, norms, SiLU, rotary and decode
      attention, with every linear weight in float32 panels (``cpu_compact_weights=False``);
  (f) cbserve as shipped (``cpu_ops="auto"`` = native, compact weights): the same kernels reading each
      weight in the smallest format that holds its float32 values exactly, here the GGUF's own Q4_1 / Q8_0
      blocks, decoded to the same float32 values in registers. ``--systems`` picks a subset of c-f.

It also measures the large fp32 GEMM rate of this machine (torch's BLAS, oneDNN and cbserve's float32 panel
kernel; the fastest is the roofline; every system does the same float32 arithmetic) and reports each
system's fraction of that roofline: useful FLOPs = 2 x non-embedding params per prompt and output token
+ 2 x LM-head params per output token. Greedy outputs of every cbserve run and HF continuous batching are
compared token by token.
Prints a table, writes ``bench_cpu.json`` and ``bench_cpu.png`` to ``--out-dir``.

    python benchmarks/bench_cpu.py                 # ~10 min on 2 cores
    python benchmarks/bench_cpu.py --num-requests 8 --outputs 4 8 --skip-static   # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# cbserve configurations: name -> (label, ModelConfig.cpu_ops, cpu_compact_weights); attention follows cpu_ops.
CBSERVE_SYSTEMS = {
    "torch": ("cbserve, plain torch", "torch", False),
    "onednn": ("cbserve, oneDNN linears", "onednn", False),
    "dense": ("cbserve, f32 panels", "native", False),
    "native": ("cbserve", "native", True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--outputs", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-static", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true")
    p.add_argument("--systems", nargs="+", choices=list(CBSERVE_SYSTEMS), default=list(CBSERVE_SYSTEMS),
                   help="cbserve configurations to run (the last one named is the reference of the ratios)")
    p.add_argument("--cpu-isa", choices=["auto", "avx512", "avx2", "scalar"], default="auto",
                   help="the C kernels' build for the native systems (auto: the CPU's best)")
    p.add_argument("--out-dir", default="bench_results")
    return p.parse_args()


def _rate(fn: Any, flops: float, iters: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return flops * iters / (time.perf_counter() - t0)


def _matmul_fns(weights: list[torch.Tensor], blocks: list[Any] | None = None, isa: str = "auto"
                ) -> dict[str, list[Any]]:
    """For each available library, one ``f(x)`` per weight computing ``x @ w.T``; with ``blocks`` (the GGUF
    blocks of each weight) also cbserve's kernel on its compact panels."""
    from cbserve.worker.cpu.linear import make_packed_weight, packing_supported
    from cbserve.worker.cpu.native import load_cpu_kernels

    def packed(w: torch.Tensor, kernels: Any, b: Any = None) -> Any:
        p = make_packed_weight(w, kernels, b, compact=b is not None)
        return lambda x: p.matmul(x, None)

    fns: dict[str, list[Any]] = {"torch BLAS": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]}
    if packing_supported(weights[0]):
        fns["oneDNN packed"] = [packed(w, None) for w in weights]
    kernels = load_cpu_kernels(isa).kernels
    if kernels is not None:
        fns["cbserve f32 panels"] = [packed(w, kernels) for w in weights]
        if blocks is not None:
            fns["cbserve compact"] = [packed(w, kernels, b) for w, b in zip(weights, blocks, strict=True)]
    return fns


def gemm_rates(n: int = 2048, iters: int = 10, isa: str = "auto") -> dict[str, float]:
    """Sustained fp32 FLOP/s of a large square matmul through torch's BLAS (MKL), oneDNN with a pre-packed
    weight and cbserve's panel kernel; the fastest is the machine's practical roofline."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    with torch.inference_mode():
        return {name: _rate(lambda f=fs[0]: f(a), 2 * n**3, iters) for name, fs in _matmul_fns([b], None, isa).items()}


def decode_gemm_rates(model: torch.nn.Module, rows: int, blocks: dict[str, Any], iters: int = 3,
                      isa: str = "auto") -> dict[str, float]:
    """FLOP/s of one decode step's matmuls alone, per library: every linear weight of the model (and the LM
    head) in turn against ``rows`` tokens, the weights streamed from memory as in a real step. This, not
    the large square GEMM, bounds a decode step on a CPU. ``blocks``: the checkpoint's GGUF blocks by name."""
    linears = [(name, m.weight) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    weights = [w for _, w in linears]
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.config.tie_word_embeddings else {}
    by_weight = [blocks.get(tied.get(f"{n}.weight", f"{n}.weight")) for n, _ in linears]
    xs = [torch.randn(rows, w.shape[1]) for w in weights]
    flops = sum(2 * rows * w.numel() for w in weights)
    with torch.inference_mode():
        return {name: _rate(lambda fs=fs: [f(x) for f, x in zip(fs, xs, strict=True)], flops, iters)
                for name, fs in _matmul_fns(weights, by_weight if all(by_weight) else None, isa).items()}


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_requests)]
    outs = [rng.choice(args.outputs) for _ in range(args.num_requests)]
    return prompts, outs


def useful_flops(model: torch.nn.Module, prompts: list[list[int]], outs: list[int]) -> float:
    emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    non_emb = total - emb - (0 if model.config.tie_word_embeddings else head)
    n_prompt, n_out = sum(map(len, prompts)), sum(outs)
    return 2 * non_emb * (n_prompt + n_out) + 2 * head * n_out


def run_hf_static(model: Any, prompts: list[list[int]], outs: list[int], batch: int) -> dict[str, Any]:
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for s in tqdm(range(0, len(prompts), batch), desc="HF static", unit="batch"):
        idx = list(range(s, min(s + batch, len(prompts))))
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        longest = max(outs[i] for i in idx)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        for row, i in enumerate(idx):
            tokens[i] = gen[row, width:width + outs[i]].tolist()
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


def run_hf_cb(model: Any, prompts: list[list[int]], outs: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.max_num_seqs,
                                  max_batch_tokens=args.max_num_batched_tokens)
    tokens: dict[int, list[int]] = {}
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=60) as manager:
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        with tqdm(total=len(prompts), desc="HF continuous", unit="req") as bar:
            while len(tokens) < len(prompts):
                res = manager.get_result(timeout=5)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("HF continuous-batching thread stopped")
                    continue
                if res.is_finished():
                    if res.error:
                        raise RuntimeError(f"HF request {res.request_id}: {res.error}")
                    tokens[int(res.request_id[1:])] = list(res.generated_tokens)
                    bar.update(1)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens}


def run_cbserve(prompts: list[list[int]], outs: list[int], args: argparse.Namespace, cpu_ops: str,
                compact: bool) -> dict[str, Any]:
    from cbserve import LLM, SamplingParams

    isa = {"cpu_isa": args.cpu_isa} if cpu_ops == "native" else {}
    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, progress=False, cpu_ops=cpu_ops, cpu_compact_weights=compact, **isa)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    llm.shutdown()
    return {"seconds": seconds, "tokens": {i: r.outputs[0].token_ids for i, r in enumerate(res)}}


def summarize(name: str, run: dict[str, Any], outs: list[int], flops: float, rate: float) -> dict[str, Any]:
    useful = sum(outs)
    return {"system": name, "seconds": run["seconds"], "output_tok_s": useful / run["seconds"],
            "roofline_fraction": flops / run["seconds"] / rate}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(rows: list[dict[str, Any]], meta: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["system"] for r in rows]
    vals = [r["output_tok_s"] for r in rows]
    ax.tick_params(axis="x", labelsize=8)
    bars = ax.bar(names, vals, color=["#999999", "#6699cc", "#e8c8a0", "#e0a080", "#d08060", "#cc5533"][-len(rows):])
    for b, r in zip(bars, rows, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r['output_tok_s']:.0f} tok/s\n"
                f"{100 * r['roofline_fraction']:.0f}% roofline", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("useful output tokens / s")
    ax.set_ylim(0, max(vals) * 1.3)
    ax.set_title("Burst workload, SmolLM2-135M fp32 on CPU", fontsize=10)
    fig.text(0.01, 0.01, meta, fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _meta(args: argparse.Namespace, num_prompts: int) -> str:
    """The plot's caption: the CPU and the C kernels' ISA build, threads, torch, the workload, the commit."""
    from cbserve.bench.report import cpu_model
    from cbserve.worker.cpu.native import resolve_isa

    return (f"{cpu_model()}, C kernels {resolve_isa(args.cpu_isa)}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}; {num_prompts} reqs, prompts {args.min_prompt}-{args.max_prompt}, outputs "
            f"{args.outputs}; commit {_commit()}")


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from cbserve.worker.cpu.malloc import tune_malloc_for_cpu_inference

    # cbserve's workers set these glibc malloc options; set them for the whole process first so that the
    # HF runs get them too and the ratios measure the engines, not the allocator.
    print(f"glibc malloc tuned for every system in this run: {tune_malloc_for_cpu_inference()}")
    from transformers import AutoModelForCausalLM

    from cbserve.worker.cpu.gguf_blocks import load_gguf_blocks
    from cbserve.worker.loading.model_loader import resolve_model

    folder = resolve_model(None).folder
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, outs = make_workload(args, model.config.vocab_size)
    rates = gemm_rates(isa=args.cpu_isa)
    rate = max(rates.values())
    flops = useful_flops(model, prompts, outs)
    blocks = load_gguf_blocks(folder)
    decode_rates = {m: decode_gemm_rates(model, m, blocks, isa=args.cpu_isa) for m in (1, 8, 11, 16, 32, 64)}
    print("large fp32 GEMM: " + ", ".join(f"{k} {r / 1e9:.1f} GFLOP/s" for k, r in rates.items())
          + f" on {torch.get_num_threads()} threads; roofline = the fastest, {rate / 1e9:.1f} GFLOP/s")
    print(f"useful work {flops / 1e12:.2f} TFLOP; {len(prompts)} requests, {sum(outs)} output tokens")
    print("decode-step matmuls alone (all weights streamed), GFLOP/s:")
    for m, by_lib in decode_rates.items():
        print(f"  {m:3d} rows: " + ", ".join(f"{k} {r / 1e9:.1f}" for k, r in by_lib.items()))
    runs: dict[str, dict[str, Any]] = {}
    if not args.skip_static:
        runs["HF static (batch 16)"] = run_hf_static(model, prompts, outs, args.static_batch)
    if not args.skip_hf_cb:
        runs["HF continuous batching"] = run_hf_cb(model, prompts, outs, args)
    del model
    for system in args.systems:
        label, cpu_ops, compact = CBSERVE_SYSTEMS[system]
        runs[label] = run_cbserve(prompts, outs, args, cpu_ops, compact)
    rows = [summarize(k, v, outs, flops, rate) for k, v in runs.items()]
    cb = rows[-1]["output_tok_s"]
    print(f"\n{'system':<28}{'seconds':>9}{'out tok/s':>11}{'roofline':>10}{'last is x':>11}")
    for r in rows:
        print(f"{r['system']:<28}{r['seconds']:>9.1f}{r['output_tok_s']:>11.1f}"
              f"{100 * r['roofline_fraction']:>9.1f}%{cb / r['output_tok_s']:>10.2f}x")
    ref = runs.get("HF continuous batching") or runs.get("HF static (batch 16)")
    if ref is not None:
        for name in [k for k in runs if k.startswith("cbserve")]:
            same = sum(ref["tokens"][i] == runs[name]["tokens"][i] for i in range(len(prompts)))
            print(f"greedy outputs of {name} identical to HF: {same}/{len(prompts)} requests")
    meta = _meta(args, len(prompts))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_cpu.json").write_text(json.dumps(
        {"gemm_flops": rate, "gemm_flops_by_library": rates, "decode_gemm_flops_by_rows": decode_rates,
         "useful_flops": flops, "rows": rows, "meta": meta}, indent=2))
    plot(rows, meta, out_dir / "bench_cpu.png")
    print(f"wrote {out_dir / 'bench_cpu.json'} and {out_dir / 'bench_cpu.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
