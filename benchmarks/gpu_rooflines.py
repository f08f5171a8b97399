"""The measurements of ``bench_gpu.py`` and ``gpu_check.py``: device copy bandwidth and GEMM throughput, decode and
prefill steps against their rooflines, decode steps with CUDA graphs on vs off, the FLOPs of a workload and the
ideal schedule of a burst on measured step times.

Timings that compare two ways of running a step (``time_interleaved``) warm every way up first, then time
repeats in turn (each way leads in turn), and report the median repeat: no way pays the process's cold start."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, iters: int = 10, warmup: int = 3) -> float:
    """Mean seconds per call (one run of ``iters`` calls after ``warmup``)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one way of running a step: the mean of each repeat, and their median."""

    repeats_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.repeats_s)

    def record(self) -> dict[str, Any]:
        """Milliseconds, as check.json holds them: the median and every repeat."""
        return {
            "median_ms": self.median_s * 1e3,
            "min_ms": min(self.repeats_s) * 1e3,
            "max_ms": max(self.repeats_s) * 1e3,
            "repeats_ms": [round(t * 1e3, 4) for t in self.repeats_s],
        }


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int = 5,
    iters: int = 10,
    warmup: int = 3,
    warmup_s: float = 0.0,
) -> dict[str, Timing]:
    """Time several ways of running the same step: each is warmed up first (at least ``warmup`` calls and
    ``warmup_s`` seconds), then ``repeats`` rounds time ``iters`` calls of every way, the order rotated each round
    so that no way always runs first. Each way's repeats and median, by name."""
    if repeats < 1 or iters < 1 or not fns:
        raise ValueError(
            f"time_interleaved needs ways to time, repeats >= 1 and iters >= 1: {list(fns)}, {repeats}, {iters}"
        )
    names = list(fns)
    for name in names:
        until, calls = time.perf_counter() + warmup_s, 0
        while calls < warmup or time.perf_counter() < until:
            fns[name]()
            calls += 1
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        lead = r % len(names)
        for name in names[lead:] + names[:lead]:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                fns[name]()
            sync(device)
            samples[name].append((time.perf_counter() - t0) / iters)
    return {name: Timing(tuple(ts)) for name, ts in samples.items()}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 1) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + write counted); the median of ``repeats``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = time_interleaved({"copy": lambda: dst.copy_(src)}, device, repeats=repeats, iters=20)["copy"]
    return 2 * nbytes / t.median_s


def matmul_flops(device: torch.device, n: int = 8192, repeats: int = 1) -> float:
    """FLOP/s of an ``n`` x ``n`` GEMM (bf16 on CUDA; float32 and n = 512 on the CPU); the median of ``repeats``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = time_interleaved({"gemm": lambda: a @ b}, device, repeats=repeats, iters=10)["gemm"]
    return 2 * n**3 / t.median_s


def _batch(runner: Any, n: int, ctx: int, new_tokens: int, first_block: int = 0) -> Any:
    """``n`` requests with ``ctx`` tokens of context each, ``new_tokens`` of them computed this step."""
    from cbserve.scheduler.requests.sampling_params import SamplingParams
    from cbserve.worker.runner.input_batch import CachedRequestState, build_batch

    bs = runner.block_size
    per = -(-ctx // bs)
    if first_block + n * per > runner.num_blocks:
        raise ValueError(f"{n} x {ctx} tokens need {n * per} blocks, the cache has {runner.num_blocks}")
    states = [
        CachedRequestState(
            f"b{r}",
            [7] * ctx,
            ctx - new_tokens,
            SamplingParams(),
            list(range(first_block + r * per, first_block + (r + 1) * per)),
            ctx - new_tokens,
        )
        for r in range(n)
    ]
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
    states = [
        CachedRequestState(f"d{r}", [7] * ctx, ctx - 1, SamplingParams(), list(range(r * per, (r + 1) * per)), ctx - 1)
        for r in range(decodes)
    ]
    first = decodes * per
    states.append(
        CachedRequestState("p", [7] * chunk, chunk, SamplingParams(), list(range(first, first + chunk_blocks)), 0)
    )
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
    """Bytes read per step: every parameter except the embedding table (only a few rows are gathered), and with
    ``quantization="fp8"`` each linear layer's e4m3 weight and scales (its dense parameter is released: empty)."""
    from cbserve.worker.layers.fp8_linear import Fp8Weight

    emb = model.model.embed_tokens.weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    fp8 = 0
    for m in model.modules():
        packed = getattr(m, "packed", None)
        if isinstance(packed, Fp8Weight):
            fp8 += sum(t.numel() * t.element_size() for t in (packed.weight, packed.scale))
    return dense + fp8


def decode_rooflines(args: argparse.Namespace, runner: Any, bw: float) -> list[dict[str, float]]:
    wbytes = _weight_bytes(runner.model)
    kv_per_token = runner.block_bytes() // runner.block_size
    rows = []
    for b in args.decode_batches:
        ctx = min(args.decode_context, runner.max_model_len, runner.num_blocks // b * runner.block_size)
        t = time_fn(_step_fn(runner, _batch(runner, b, ctx, 1)), runner.device)
        t_min = (wbytes + b * ctx * kv_per_token) / bw
        rows.append(
            {
                "batch": b,
                "context": ctx,
                "step_ms": t * 1e3,
                "roofline_ms": t_min * 1e3,
                "efficiency": t_min / t,
                "tok_s": b / t,
            }
        )
    return rows


def prefill_roofline(args: argparse.Namespace, runner: Any, flops_peak: float, repeats: int = 1) -> dict[str, Any]:
    """A step of ``max_num_batched_tokens // prompt_len`` whole prompts against ``flops_peak`` (the median of
    ``repeats`` timed rounds)."""
    n = max(1, args.max_num_batched_tokens // args.prompt_len)
    batch = _batch(runner, n, args.prompt_len, args.prompt_len)
    ways = {"prefill": _step_fn(runner, batch)}
    timing = time_interleaved(ways, runner.device, repeats=repeats, iters=3, warmup=2)["prefill"]
    t = timing.median_s
    tokens = n * args.prompt_len
    flops = n * request_flops(runner.hf_config, args.prompt_len, 1)
    t_min = flops / flops_peak
    return {
        "tokens": tokens,
        "prompts": n,
        "step_ms": t * 1e3,
        "roofline_ms": t_min * 1e3,
        "efficiency": t_min / t,
        "tflops": flops / t / 1e12,
        "timing": timing.record(),
    }


def linear_params(cfg: Any) -> int:
    """Parameters of a Llama-shaped model's layers that every token multiplies (no embedding, no LM head)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    hd = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return cfg.num_hidden_layers * (h * q + 2 * h * kv + q * h + 3 * h * i)


def request_flops(cfg: Any, isl: int, osl: int) -> float:
    """FLOPs of one request of ``isl`` prompt tokens and ``osl`` output tokens: its ``isl + osl - 1`` tokens through
    the layers (2 per parameter), causal attention over the context of each (QK^T and PV, 2 x 2 per head dim) and
    the LM head for each of the ``osl`` samples."""
    n = isl + osl - 1
    hd = cfg.hidden_size // cfg.num_attention_heads
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * n * (n + 1) / 2
    return 2 * linear_params(cfg) * n + attention + 2 * cfg.vocab_size * cfg.hidden_size * osl


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``points`` (sorted by x), extended linearly past the last two points and
    held at the first point's y below it."""
    pts = sorted(points)
    if not pts:
        raise ValueError("interpolate needs at least one point")
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def ideal_schedule(
    prompt_lens: Sequence[int],
    outs: Sequence[int],
    prefill_tokens: int,
    prefill_s: float,
    decode_s: Sequence[tuple[int, float]],
) -> dict[str, float]:
    """The burst run as prefill-then-decode on measured step times: every prompt token at the measured prefill
    rate (``prefill_tokens`` in ``prefill_s``), each request's first token from its prefill, then one decode step
    per further output token, at the step time of the batch still running (``decode_s``: (batch, seconds),
    interpolated). The seconds this takes and the output tokens/s it reaches."""
    prefill = sum(prompt_lens) / prefill_tokens * prefill_s
    decode = sum(interpolate(decode_s, sum(o > k for o in outs)) for k in range(1, max(outs, default=1)))
    seconds = prefill + decode
    return {"prefill_s": prefill, "decode_s": decode, "seconds": seconds, "output_tok_s": sum(outs) / seconds}


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
        rows.append(
            {
                "batch": b,
                "bucket": graphs.bucket(b),
                "context": ctx,
                "eager_ms": eager * 1e3,
                "graph_ms": graph * 1e3,
                "speedup": eager / graph,
            }
        )
    return rows
