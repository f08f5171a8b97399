"""The measurements of ``bench_gpu.py`` beside the end-to-end runs: device copy bandwidth and GEMM
throughput, decode and prefill steps against their rooflines, and decode steps with CUDA graphs on vs off."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch


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



def _batch(runner: Any, n: int, ctx: int, new_tokens: int, first_block: int = 0) -> Any:
    """``n`` requests with ``ctx`` tokens of context each, ``new_tokens`` of them computed this step."""
    from cbserve.scheduler.requests.sampling_params import SamplingParams
    from cbserve.worker.runner.input_batch import CachedRequestState, build_batch

    bs = runner.block_size
    per = -(-ctx // bs)
    if first_block + n * per > runner.num_blocks:
        raise ValueError(f"{n} x {ctx} tokens need {n * per} blocks, the cache has {runner.num_blocks}")
    states = [CachedRequestState(f"b{r}", [7] * ctx, ctx - new_tokens, SamplingParams(),
                           list(range(first_block + r * per, first_block + (r + 1) * per)), ctx - new_tokens)
              for r in range(n)]
    return build_batch(states, {s.req_id: new_tokens for s in states}, bs, runner.device)


def _mixed_batch(runner: Any, decodes: int, ctx: int, chunk: int) -> Any:
    """``decodes`` requests decoding at ``ctx`` tokens of context, then one prompt's ``chunk``-token prefill chunk
    (its first): the step the scheduler builds when a request arrives while others decode."""
    from cbserve.scheduler.requests.sampling_params import SamplingParams
    from cbserve.worker.runner.input_batch import CachedRequestState, build_batch

    bs = runner.block_size
    per, chunk_blocks = -(-ctx // bs), -(-chunk // bs)
    if decodes * per + chunk_blocks > runner.num_blocks:
        raise ValueError(f"{decodes} x {ctx} + {chunk} tokens do not fit the cache's {runner.num_blocks} blocks")
    states = [CachedRequestState(f"d{r}", [7] * ctx, ctx - 1, SamplingParams(), list(range(r * per, (r + 1) * per)),
                                 ctx - 1) for r in range(decodes)]
    first = decodes * per
    states.append(CachedRequestState("p", [7] * chunk, chunk, SamplingParams(),
                                     list(range(first, first + chunk_blocks)), 0))
    sched = {s.req_id: 1 for s in states[:-1]} | {"p": chunk}
    return build_batch(states, sched, bs, runner.device)


def _step_fn(runner: Any, batch: Any, graphs: Any = None) -> Callable[[], torch.Tensor]:
    model, md = runner.model, batch.metadata
    md.prepared = runner.attention_builder.build(md)  # the step's attention plan, as the runner builds it

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
    """Decode steps replayed from the runner's CUDA graphs (captured when its KV cache was allocated) vs
    the same steps run eagerly; empty without graphs (CPU, enforce_eager, a backend without support)."""
    graphs = runner.graphs
    if graphs is None:
        return []
    batches = [b for b in args.graph_batches if b <= graphs.max_batch]
    if not batches:
        return []
    ctx = min(args.decode_context, runner.max_model_len, runner.num_blocks // max(batches) * runner.block_size)
    rows = []
    for b in batches:
        batch = _batch(runner, b, ctx, 1)
        eager = time_fn(_step_fn(runner, batch), runner.device, iters=20)
        graph = time_fn(_step_fn(runner, batch, graphs), runner.device, iters=20)
        rows.append({"batch": b, "bucket": graphs.bucket(b), "context": ctx, "eager_ms": eager * 1e3,
                     "graph_ms": graph * 1e3, "speedup": eager / graph})
    return rows


