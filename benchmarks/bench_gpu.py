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
Prints a table and writes ``bench_gpu.png`` + ``bench_gpu.json`` to ``--out-dir``.

    python benchmarks/bench_gpu.py                        # H100/H200, ~5 min
    python benchmarks/bench_gpu.py --preset tiny --device cpu --num-requests 8 --prompt-len 32 \\
        --min-out 4 --max-out 8 --decode-batches 2 4 --graph-batches 1 --skip-hf   # plumbing smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0, max_position_embeddings=4096,
                 rms_norm_eps=1e-5),
}


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
    p.add_argument("--decode-batches", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--decode-context", type=int, default=1024, help="context length per request")
    p.add_argument("--graph-batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_results")
    return p.parse_args()


# ------------------------------------------------------------------------------------------- utilities


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, iters: int = 10, warmup: int = 3) -> float:
    """Mean seconds per call."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, iters=20)
    return 2 * nbytes / t


def matmul_flops(device: torch.device, n: int = 8192) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / time_fn(lambda: a @ b, device, iters=10)


# ------------------------------------------------------------------------------------ model + weights


def write_model_folder(preset: str, folder: Path) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**PRESETS[preset], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.save_pretrained(folder)
    return cfg


def random_weights(cfg: Any, device: torch.device, dtype: torch.dtype, seed: int
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named Llama tensors, seeded, generated on ``device`` one at a time."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    yield "model.embed_tokens.weight", rnd(v, h)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))):
            yield f"{p}{name}.weight", rnd(*shape)
        yield f"{p}input_layernorm.weight", torch.ones(h, dtype=dtype, device=device)
        yield f"{p}post_attention_layernorm.weight", torch.ones(h, dtype=dtype, device=device)
    yield "model.norm.weight", torch.ones(h, dtype=dtype, device=device)
    yield "lm_head.weight", rnd(v, h)


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    outs = [rng.randint(args.min_out, args.max_out) for _ in range(args.num_requests)]
    return prompts, outs


# ------------------------------------------------------------------------------------------- cbserve


def build_cbserve(args: argparse.Namespace, folder: Path, cfg: Any, device: torch.device) -> Any:
    from cbserve.worker import model_runner
    from cbserve.worker.config import ModelConfig
    from cbserve.worker.executor import LocalExecutor

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mc = ModelConfig(model=str(folder), dtype="bfloat16" if device.type == "cuda" else "float32",
                     device=device.type, max_model_len=args.prompt_len + args.max_out,
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     kv_cache_memory_bytes=1 << 28, attention_backend=args.attention_backend)
    weights = lambda folder, progress=True: random_weights(cfg, device, dtype, args.seed)  # noqa: ARG005
    with mock.patch.object(model_runner, "iter_weights", weights):
        return LocalExecutor(mc, block_size=16, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_num_seqs=args.max_num_seqs, progress=False)


def run_cbserve_e2e(args: argparse.Namespace, executor: Any, prompts: list[list[int]], outs: list[int]
                    ) -> dict[str, float]:
    from cbserve.scheduler.config import CacheConfig, EngineConfig, SchedulerConfig
    from cbserve.scheduler.engine_core import EngineCore
    from cbserve.scheduler.request import EngineRequest
    from cbserve.scheduler.sampling_params import SamplingParams

    sched = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.max_out)
    config = EngineConfig(
        scheduler=sched,
        cache=CacheConfig(block_size=16, num_blocks=executor.num_blocks, enable_prefix_caching=False))
    engine = EngineCore(config, executor)
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        sp = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", p, sp))
    first: dict[str, float] = {}
    tokens, steps = 0, 0
    while engine.has_unfinished_requests():
        res = engine.step()
        now, steps = time.perf_counter(), steps + 1
        for out in res.outputs:
            if out.new_token_ids:
                first.setdefault(out.req_id, now - t0)
                tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    ttft = sorted(first.values())
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "total_tok_s": (tokens + sum(map(len, prompts))) / elapsed, "steps": steps,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else float("nan")}


def _batch(runner: Any, n: int, ctx: int, new_tokens: int, first_block: int = 0) -> Any:
    """``n`` requests with ``ctx`` tokens of context each, ``new_tokens`` of them computed this step."""
    from cbserve.scheduler.sampling_params import SamplingParams
    from cbserve.worker.input_batch import RequestState, build_batch

    bs = runner.block_size
    per = -(-ctx // bs)
    if first_block + n * per > runner.num_blocks:
        raise ValueError(f"{n} x {ctx} tokens need {n * per} blocks, the cache has {runner.num_blocks}")
    states = [RequestState(f"b{r}", [7] * ctx, ctx - new_tokens, SamplingParams(),
                           list(range(first_block + r * per, first_block + (r + 1) * per)), ctx - new_tokens)
              for r in range(n)]
    return build_batch(states, {s.req_id: new_tokens for s in states}, bs, runner.device)


def _step_fn(runner: Any, batch: Any, graphs: Any = None) -> Callable[[], torch.Tensor]:
    model, md = runner.model, batch.metadata
    model.model.layers[0].self_attn.attn.prepare(md)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        if graphs is not None:
            hidden = graphs.run(batch.input_ids, batch.positions, md)
        else:
            hidden = model(batch.input_ids, batch.positions, runner.kv_caches, md)
        return model.compute_logits(hidden.index_select(0, batch.logits_rows))

    return step


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes read per step: every parameter except the embedding table (only a few rows are gathered)."""
    emb = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def decode_rooflines(args: argparse.Namespace, runner: Any, bw: float) -> list[dict[str, float]]:
    wbytes = _weight_bytes(runner.model)
    kv_per_token = runner.block_bytes() // runner.block_size
    rows = []
    for b in args.decode_batches:
        ctx = min(args.decode_context, runner.max_model_len, runner.num_blocks // b * runner.block_size)
        t = time_fn(_step_fn(runner, _batch(runner, b, ctx, 1)), runner.device)
        t_min = (wbytes + b * ctx * kv_per_token) / bw
        rows.append({"batch": b, "context": ctx, "step_ms": t * 1e3, "roofline_ms": t_min * 1e3,
                     "efficiency": t_min / t, "tok_s": b / t})
    return rows


def prefill_roofline(args: argparse.Namespace, runner: Any, flops_peak: float) -> dict[str, float]:
    cfg = runner.hf_config
    n = max(1, args.max_num_batched_tokens // args.prompt_len)
    batch = _batch(runner, n, args.prompt_len, args.prompt_len)
    t = time_fn(_step_fn(runner, batch), runner.device, iters=5, warmup=2)
    tokens = n * args.prompt_len
    emb, head = runner.model.model.embed_tokens.weight, runner.model.lm_head.weight
    linear = sum(p.numel() for p in runner.model.parameters()
                 if p.dim() == 2 and p is not emb and p is not head)
    hd = cfg.hidden_size // cfg.num_attention_heads
    causal_pairs = n * args.prompt_len * (args.prompt_len + 1) / 2  # QK^T and PV: 2 flops x 2 matmuls each
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * causal_pairs
    flops = 2 * tokens * linear + attn + 2 * n * head.numel()
    t_min = flops / flops_peak
    return {"tokens": tokens, "step_ms": t * 1e3, "roofline_ms": t_min * 1e3, "efficiency": t_min / t,
            "tflops": flops / t / 1e12}


def graphs_on_off(args: argparse.Namespace, runner: Any) -> list[dict[str, float]]:
    from cbserve.worker.cuda_graphs import DecodeCUDAGraphs, graphs_supported

    if not graphs_supported(runner.device, runner.backend_cls, False):
        return []
    ctx = min(args.decode_context, runner.max_model_len,
              runner.num_blocks // max(args.graph_batches) * runner.block_size)
    graphs = DecodeCUDAGraphs(runner.model, runner.kv_caches, max_batch=max(args.graph_batches),
                              max_model_len=runner.max_model_len, block_size=runner.block_size,
                              num_kv_heads=runner.num_kv_heads, device=runner.device,
                              prepare=runner.model.model.layers[0].self_attn.attn.prepare,
                              sizes=args.graph_batches)
    graphs.capture()
    rows = []
    for b in args.graph_batches:
        batch = _batch(runner, b, ctx, 1)
        eager = time_fn(_step_fn(runner, batch), runner.device, iters=20)
        graph = time_fn(_step_fn(runner, batch, graphs), runner.device, iters=20)
        rows.append({"batch": b, "context": ctx, "eager_ms": eager * 1e3, "graph_ms": graph * 1e3,
                     "speedup": eager / graph})
    del graphs
    return rows


# ----------------------------------------------------------------------------------------------- HF


def run_hf_e2e(args: argparse.Namespace, cfg: Any, device: torch.device, prompts: list[list[int]],
               outs: list[int]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, t in random_weights(cfg, device, dtype, args.seed):
            params[name].copy_(t)
    model.eval()
    gen = GenerationConfig(max_new_tokens=args.max_out, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.max_num_seqs,
                                  max_batch_tokens=args.max_num_batched_tokens)
    t0 = time.perf_counter()
    tokens, first = 0, []
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=30) as manager:
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        done = 0
        while done < len(prompts):
            res = manager.get_result(timeout=5)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous-batching thread stopped")
                continue
            if res.is_finished():
                done += 1
                tokens += len(res.generated_tokens)
                if res.error:
                    raise RuntimeError(f"HF request {res.request_id}: {res.error}")
                first.append(res.lifespan[0] - t0 if res.lifespan[0] > 0 else float("nan"))
    elapsed = time.perf_counter() - t0
    del model
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "total_tok_s": (tokens + sum(map(len, prompts))) / elapsed}


# ------------------------------------------------------------------------------------------- report


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
