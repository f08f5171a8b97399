"""Part 2 of ``gpu_check.py``, speed, on a Llama-3-8B-shaped model with random bf16 weights (a dry run: the
"tiny" preset on the CPU): decode step time at batch 1/16/64/256 with CUDA graphs and eagerly against the HBM
roofline, a prefill step against the GEMM peak, and an end-to-end burst through cbserve's engine; the HF
transformers baselines are in ``gpu_check_hf.py``. The model, its random weights and the step measurements
are those of ``bench_gpu.py`` (``gpu_workload.py``, ``gpu_rooflines.py``)."""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

import torch
from gpu_rooflines import (
    _batch,
    _mixed_batch,
    _step_fn,
    _weight_bytes,
    copy_bandwidth,
    matmul_flops,
    prefill_roofline,
    time_fn,
)
from gpu_workload import build_cbserve, make_workload

# (name fragment, HBM bytes/s, dense bf16 FLOP/s) from the vendor's sheets; the first fragment found wins
NOMINAL = (("H200", 4.8e12, 989e12), ("H100 NVL", 3.9e12, 835e12), ("H100 PCIe", 2.0e12, 756e12),
           ("H100", 3.35e12, 989e12), ("A100", 2.0e12, 312e12))


def workload(dry_run: bool) -> argparse.Namespace:
    """bench_gpu.py's arguments for the check: the issue's burst (256 requests, 512-token prompts, 64-256
    output tokens) on the GPU, a few tiny requests on the CPU."""
    common = dict(attention_backend="auto", enforce_eager=False, seed=0)
    if dry_run:
        return argparse.Namespace(**common, preset="tiny", device="cpu", num_requests=8, prompt_len=32, min_out=4,
                                  max_out=8, max_num_seqs=8, max_num_batched_tokens=128,
                                  gpu_memory_utilization=0.5, decode_batches=[1, 4], decode_context=64,
                                  hf_static_batch=4, hf_warmup=False, hf_num_blocks=16, bandwidth_bytes=1 << 26,
                                  mixed_steps=[(2, 6)])
    return argparse.Namespace(**common, preset="llama3-8b", device="cuda", num_requests=256, prompt_len=512,
                              min_out=64, max_out=256, max_num_seqs=256, max_num_batched_tokens=8192,
                              gpu_memory_utilization=0.85, decode_batches=[1, 16, 64, 256], decode_context=768,
                              hf_static_batch=64, hf_warmup=True, hf_num_blocks=None, bandwidth_bytes=1 << 30,
                              mixed_steps=[(1, 32), (16, 128), (64, 256)])


def hardware(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Measured device-copy bandwidth and bf16 GEMM rate, beside the card's nominal figures."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw, flops = copy_bandwidth(device, args.bandwidth_bytes), matmul_flops(device)
    nominal = next(((b, f) for frag, b, f in NOMINAL if frag in name), (None, None))
    out = {"name": name, "copy_gb_s": bw / 1e9, "gemm_tflops": flops / 1e12,
           "nominal_hbm_gb_s": nominal[0] and nominal[0] / 1e9, "nominal_bf16_tflops": nominal[1] and nominal[1] / 1e12}
    if device.type == "cuda":
        out["memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return out


def decode_row(runner: Any, b: int, ctx: int, bw: float, nominal_bw: float | None) -> dict[str, Any]:
    """One decode step of ``b`` requests with ``ctx`` tokens of context each: eagerly, and replayed from the
    runner's CUDA graph when there is one; against (weight bytes + KV bytes read) / bandwidth."""
    ctx = min(ctx, runner.max_model_len, runner.num_blocks // b * runner.block_size)
    batch = _batch(runner, b, ctx, 1)
    eager = time_fn(_step_fn(runner, batch), runner.device, iters=10)
    graphs = runner.graphs
    graph = None
    if graphs is not None and b <= graphs.max_batch:
        graph = time_fn(_step_fn(runner, batch, graphs), runner.device, iters=20)
    kv_bytes = b * ctx * (runner.block_bytes() // runner.block_size)
    roofline = (_weight_bytes(runner.model) + kv_bytes) / bw
    served = graph if graph is not None else eager
    row = {"batch": b, "context": ctx, "eager_ms": eager * 1e3, "graph_ms": graph and graph * 1e3,
           "roofline_ms": roofline * 1e3, "roofline_fraction": roofline / served,
           "graphs_speedup": graph and eager / graph, "tok_s": b / served}
    if nominal_bw:
        row["nominal_roofline_fraction"] = roofline * bw / nominal_bw / served
    return row


class _EagerPiece:
    """A dry run's stand-in for a captured piece: a piece writes only static buffers, so a replay reruns it."""

    def __init__(self, forward: Any) -> None:
        self.replay = forward
        forward()


def _eager_pieces(forward: Any, pool: Any) -> tuple[_EagerPiece, None]:
    return _EagerPiece(forward), None


def capture_piecewise(runner: Any) -> Any:
    """Piecewise CUDA graphs (``cudagraph_mode: full_and_piecewise``) captured on the runner built with the
    decode graphs only: steps with prefill chunks measured both ways on one model."""
    from cbserve.worker.cuda.piecewise_graphs import MAX_PIECEWISE_TOKENS, PiecewiseCUDAGraphs

    kw = {} if runner.device.type == "cuda" else {"capture": _eager_pieces}  # a dry run: no CUDA graphs
    pieces = PiecewiseCUDAGraphs(runner.model, runner.kv_caches, device=runner.device,
                                 max_tokens=min(runner.max_num_batched_tokens, MAX_PIECEWISE_TOKENS), **kw)
    t0 = time.perf_counter()
    pieces.capture()
    return pieces, time.perf_counter() - t0


def mixed_row(runner: Any, pieces: Any, decodes: int, ctx: int, chunk: int) -> dict[str, Any]:
    """One step of ``decodes`` decodes and a ``chunk``-token prefill chunk, eagerly and from the pieces."""
    ctx = min(ctx, runner.max_model_len)
    batch = _mixed_batch(runner, decodes, ctx, chunk)
    eager = time_fn(_step_fn(runner, batch), runner.device, iters=10)
    piecewise = time_fn(_step_fn(runner, batch, pieces), runner.device, iters=10)
    return {"decodes": decodes, "context": ctx, "chunk": chunk, "tokens": decodes + chunk,
            "bucket": pieces.bucket(decodes + chunk), "eager_ms": eager * 1e3, "piecewise_ms": piecewise * 1e3,
            "piecewise_speedup": eager / piecewise}


def _measure_piecewise(check: Any, args: argparse.Namespace, runner: Any) -> None:
    """Mixed steps eagerly and from piecewise graphs, recorded under ``mixed`` and ``piecewise_speedup``."""
    got = check.step("piecewise.capture", capture_piecewise, runner, min_s=20)
    if got is None:
        return
    pieces, seconds = got
    check.set("piecewise", {"buckets": len(pieces.sizes), "max_tokens": pieces.max_tokens,
                            "capture_s": round(seconds, 1)})
    rows, speedup = [], {}
    for decodes, chunk in args.mixed_steps:
        row = check.step(f"mixed.d{decodes}_c{chunk}", mixed_row, runner, pieces, decodes, args.decode_context,
                         chunk, min_s=10)
        if row is None:
            continue
        rows.append(row)
        speedup[f"{decodes}+{chunk}"] = round(row["piecewise_speedup"], 3)
        check.log(f"  mixed {decodes} decodes + {chunk}-token chunk: eager {row['eager_ms']:.2f} ms, piecewise "
                  f"{row['piecewise_ms']:.2f} ms ({row['piecewise_speedup']:.2f}x)")
        check.results.update(mixed=rows, piecewise_speedup=speedup)
        check.save()
    del pieces


def prefill(args: argparse.Namespace, runner: Any, hw: dict[str, Any]) -> dict[str, Any]:
    """bench_gpu's prefill step (max_num_batched_tokens of prompt_len-token prompts) against the GEMM peak."""
    out = prefill_roofline(args, runner, hw["gemm_tflops"] * 1e12)
    if hw.get("nominal_bf16_tflops"):
        out["fraction_of_nominal_peak"] = out["tflops"] / hw["nominal_bf16_tflops"]
    return out


def cbserve_burst(args: argparse.Namespace, executor: Any, prompts: list[list[int]], outs: list[int],
                  deadline: float) -> dict[str, Any]:
    """All requests at once through EngineCore + LocalExecutor (greedy, ignore_eos), as bench_gpu's
    run_cbserve_e2e, stopped at ``deadline`` (perf_counter seconds): then the throughput so far."""
    from cbserve.scheduler.config import CacheConfig, EngineConfig, SchedulerConfig
    from cbserve.scheduler.engine_core import EngineCore
    from cbserve.scheduler.requests.request import EngineRequest
    from cbserve.scheduler.requests.sampling_params import SamplingParams

    sched = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            max_model_len=args.prompt_len + args.max_out)
    cache = CacheConfig(block_size=16, num_blocks=executor.num_blocks, enable_prefix_caching=False)
    engine = EngineCore(EngineConfig(scheduler=sched, cache=cache), executor)
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)))
    tokens, steps, finished, first = 0, 0, 0, {}
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        res = engine.step()
        steps += 1
        for out in res.outputs:
            if out.new_token_ids:
                first.setdefault(out.req_id, time.perf_counter() - t0)
            tokens += len(out.new_token_ids)
            finished += bool(out.finished)
    ttft = sorted(first.values())
    return {**rates(tokens, time.perf_counter() - t0, finished, len(prompts)), "steps": steps,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None}


def rates(tokens: int, seconds: float, finished: int, requests: int) -> dict[str, Any]:
    return {"output_tokens": tokens, "seconds": round(seconds, 2), "output_tok_s": tokens / max(seconds, 1e-9),
            "finished_requests": finished, "requests": requests, "partial": finished < requests}


def run_part2(check: Any, dry_run: bool, model_folder: Path) -> None:
    """Part 2's sub-steps, each guarded; the cbserve model is freed before the HF baselines load theirs."""
    from gpu_check_hf import hf_baselines
    from gpu_workload import write_model_folder

    args = workload(dry_run)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    hw = check.step("hardware", hardware, args, device) or {}
    check.set("hardware", hw)
    cfg = write_model_folder(args.preset, model_folder)
    check.set("model", {"preset": args.preset, "dtype": "bfloat16" if device.type == "cuda" else "float32",
                        "workload": {k: v for k, v in vars(args).items() if k != "bandwidth_bytes"}})
    prompts, outs = make_workload(args, cfg.vocab_size)
    executor = check.step("build_cbserve", build_cbserve, args, model_folder, cfg, device)
    if executor is not None:
        _measure_cbserve(check, args, executor, hw, prompts, outs)
        executor.shutdown()
        del executor
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf_baselines(check, args, cfg, device, prompts, outs)


def _measure_cbserve(check: Any, args: argparse.Namespace, executor: Any, hw: dict[str, Any],
                     prompts: list[list[int]], outs: list[int]) -> None:
    runner = executor.runner
    model = dict(check.results["model"], backend=runner.backend_cls.name, num_blocks=executor.num_blocks,
                 graphs=runner.graphs is not None, weight_gib=round(_weight_bytes(runner.model) / 2**30, 2))
    check.set("model", model)
    bw = hw.get("copy_gb_s", 0) * 1e9 or 1e12
    rows, fraction, speedup = [], {}, {}
    for b in args.decode_batches:
        row = check.step(f"decode.b{b}", decode_row, runner, b, args.decode_context, bw,
                         (hw.get("nominal_hbm_gb_s") or 0) * 1e9, min_s=10)
        if row is None:
            continue
        rows.append(row)
        fraction[str(b)] = round(row["roofline_fraction"], 4)
        if row["graphs_speedup"] is not None:
            speedup[str(b)] = round(row["graphs_speedup"], 3)
        check.log(f"  decode b={b} ctx={row['context']}: eager {row['eager_ms']:.2f} ms, graph "
                  f"{row['graph_ms'] or float('nan'):.2f} ms, roofline {row['roofline_ms']:.2f} ms "
                  f"({row['roofline_fraction']:.0%})")
        check.results.update(decode=rows, decode_roofline_fraction=fraction, graphs_speedup=speedup)
        check.save()
    _measure_piecewise(check, args, runner)
    pf = check.step("prefill", prefill, args, runner, hw, min_s=10)
    if pf is not None:
        check.set("prefill", pf)
        check.log(f"  prefill {pf['tokens']} tokens: {pf['step_ms']:.1f} ms, {pf['tflops']:.1f} TFLOP/s")
    deadline = time.perf_counter() + min(90.0, max(10.0, check.remaining() - 150))
    e2e = check.step("e2e.cbserve", cbserve_burst, args, executor, prompts, outs, deadline, min_s=30)
    if e2e is not None:
        check.results.setdefault("e2e", {})["cbserve"] = e2e
        check.results["throughput"] = dict(check.results.get("throughput") or {}, cbserve=e2e["output_tok_s"])
        check.save()
        check.log(f"  cbserve burst: {e2e['output_tok_s']:.0f} output tok/s ({e2e['seconds']:.1f} s)")
