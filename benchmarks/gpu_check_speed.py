"""Part 2 of ``gpu_check.py``, speed, on a Llama-3.1-8B-shaped model with random bf16 weights (a dry run: the
"tiny" preset on the CPU), in the order of what the goals need most: the card's copy bandwidth and GEMM rate;
decode steps at batch 1/16/64/256 with CUDA graphs and eagerly against the copy-bandwidth roofline; a prefill
step against the GEMM rate; the 256-request burst through cbserve's offline engine with a step timeline,
against its ideal prefill-then-decode schedule on the measured step times; the peer workloads
(``gpu_check_peers.py``); then, with what is left before the FP8 group's reserve, steps mixing decodes with a
prefill chunk eagerly and from piecewise CUDA graphs, and the burst again replaying the piecewise graphs; last,
the bf16 model freed, the FP8 group (``gpu_check_fp8.py``). Every comparison of two ways of running a step is
the median of interleaved repeats after a warm-up of both (``gpu_rooflines.time_interleaved``); the step
timings themselves are ``gpu_check_steps.py``'s. ``plan_s`` is how the part's budget is split."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_engine import RunSpec, StepTimeline, drive, new_engine, summarize
from gpu_check_fp8 import plan_s as fp8_plan_s
from gpu_check_fp8 import run_fp8
from gpu_check_goals import nominal
from gpu_check_peers import peer_workloads, run_peers
from gpu_check_steps import capture_piecewise, decode_row, mixed_row, release_memory
from gpu_rooflines import _weight_bytes, copy_bandwidth, ideal_schedule, matmul_flops, prefill_roofline
from gpu_workload import build_cbserve, make_workload, serve_config


def plan_s(dry_run: bool) -> dict[str, float]:
    """Part 2's budget (290 s on the GPU) split by group, in the order they run. Measured on the H200 (the record's
    ``parts.2.steps`` and log, before the peers existed): startup with hardware and the model folder 6.5 s, the
    build 5.8 s, four decode rows 1.8 s, the prefill row 1.2 s, the burst 9.0 s; each planned with a margin. Not
    yet timed on a GPU, so estimated: the concurrency-1 run (2 x 1000 tokens at ~5-6 ms), the 2048/128 and
    concurrency-250 runs (their caps: the latter needs 500,000 tokens / 6,059 tok/s = 83 s at the H100 goal, 58 s
    at the H200's, so a run that needs more than its 90 s fails its goal whether cut or not), the piecewise group
    (capture, three mixed rows, a burst) and the FP8 group (``gpu_check_fp8.plan_s``). The peers stop before the
    seconds planned after them (``reserve_after``); the piecewise group runs only where the FP8 group keeps its
    own."""
    fp8 = sum(fp8_plan_s(dry_run).values())
    if dry_run:
        steps = {
            "startup": 3,
            "build": 2,
            "decode": 2,
            "prefill": 1,
            "burst": 2,
            "peers.c1_1000_1000": 2,
            "peers.max_2048_128": 2,
            "peers.c250_1000_1000": 3,
            "piecewise": 5,
            "fp8": fp8,
            "end": 3,
        }
    else:
        steps = {
            "startup": 8,
            "build": 8,
            "decode": 4,
            "prefill": 2,
            "burst": 12,
            "peers.c1_1000_1000": 15,
            "peers.max_2048_128": 35,
            "peers.c250_1000_1000": 90,
            "piecewise": 30,
            "fp8": fp8,
            "end": 5,
        }
    return {k: float(v) for k, v in steps.items()}


def reserve_after(plan: dict[str, float], group: str) -> float:
    """The seconds ``plan`` keeps for the groups after ``group`` ("peers" or "piecewise") and the part's end."""
    order = list(plan)
    last = max(i for i, k in enumerate(order) if k == group or k.startswith(group + "."))
    return sum(plan[k] for k in order[last + 1 :])


def workload(dry_run: bool) -> argparse.Namespace:
    """The check's workload: the burst (256 requests, 512-token prompts, 64-256 output tokens), the step shapes,
    the timing repeats and the HF baselines' settings on the GPU; a few tiny requests on the CPU."""
    common = dict(attention_backend="auto", enforce_eager=False, seed=0, hf_sweep_tokens=(4, 20))
    if dry_run:
        return argparse.Namespace(
            **common,
            preset="tiny",
            device="cpu",
            num_requests=8,
            prompt_len=32,
            min_out=4,
            max_out=8,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            max_model_len=64,
            gpu_memory_utilization=0.5,
            decode_batches=[1, 4],
            decode_context=40,
            repeats=3,
            hf_static_batches=[2, 4],
            hf_warmup=False,
            hf_num_blocks=16,
            bandwidth_bytes=1 << 26,
            mixed_steps=[(2, 6)],
        )
    return argparse.Namespace(
        **common,
        preset="llama3-8b",
        device="cuda",
        num_requests=256,
        prompt_len=512,
        min_out=64,
        max_out=256,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2176,
        gpu_memory_utilization=0.9,
        decode_batches=[1, 16, 64, 256],
        decode_context=768,
        repeats=5,
        hf_static_batches=[64, 128, 256],
        hf_warmup=True,
        hf_num_blocks=None,
        bandwidth_bytes=1 << 30,
        mixed_steps=[(1, 32), (16, 128), (64, 256)],
    )


def hardware(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Measured device-copy bandwidth and bf16 GEMM rate (medians of repeats), beside the card's nominal figures."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = copy_bandwidth(device, args.bandwidth_bytes, repeats=args.repeats)
    flops = matmul_flops(device, repeats=args.repeats)
    card = nominal(name)
    out = {
        "name": name,
        "copy_gb_s": bw / 1e9,
        "gemm_tflops": flops / 1e12,
        "nominal_hbm_gb_s": card and card[1] / 1e9,
        "nominal_bf16_tflops": card and card[2] / 1e12,
    }
    if device.type == "cuda":
        out["memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return out


def burst(
    check: Any, args: argparse.Namespace, executor: Any, serve_cfg: Any, name: str, reserve_s: float
) -> dict[str, Any]:
    """The burst: every request at once through cbserve's offline engine, with a step timeline (its rows in
    ``timeline_<name>.json``, its summary in the result), to a deadline at most 90 s away that leaves
    ``reserve_s`` of the part's budget (``partial`` when it cuts the burst)."""
    prompts, outs = make_workload(args, executor.runner.hf_config.vocab_size)
    deadline = time.perf_counter() + min(90.0, max(10.0, check.remaining() - reserve_s))
    timeline = StepTimeline(executor)
    with timeline.attached():
        result = drive(new_engine(serve_cfg, timeline), RunSpec(prompts, outs, None, deadline))
    rows = timeline.rows()
    path = check.out / f"timeline_{name}.json"
    path.write_text(json.dumps({"run": name, "card": check.results.get("device"), "steps": rows}) + "\n")
    return {**result, "timeline": {**summarize(rows), "file": path.name}}


def schedule_fraction(args: argparse.Namespace, result: dict[str, Any], vocab: int) -> dict[str, Any] | None:
    """The burst's throughput against its ideal prefill-then-decode schedule on the measured step times
    (``gpu_rooflines.ideal_schedule``: the prefill row's rate, the decode rows' served step times at their
    measured context), beside the seconds its timeline spent in each kind of step and between steps; None without
    those rows."""
    rows, pf = result.get("decode") or [], result.get("prefill")
    if not rows or not pf:
        return None
    prompts, outs = make_workload(args, vocab)  # the burst's own lengths (the same seeded draws)
    decode_s = [(r["batch"], (r["graph_ms"] or r["eager_ms"]) / 1e3) for r in rows]
    ideal = ideal_schedule([len(p) for p in prompts], outs, pf["tokens"], pf["step_ms"] / 1e3, decode_s)
    burst_row = (result.get("e2e") or {}).get("cbserve") or {}
    measured, timeline = burst_row.get("output_tok_s"), burst_row.get("timeline") or {}
    return {
        **ideal,
        "measured_output_tok_s": measured,
        "fraction": measured / ideal["output_tok_s"] if measured else None,
        "partial": burst_row.get("partial"),
        "decode_context": rows[0]["context"],
        "measured_s": {k: round(v["step_ms"] / 1e3, 4) for k, v in (timeline.get("by_kind") or {}).items()},
        "measured_host_gap_s": round((timeline.get("host_gap_ms") or 0.0) / 1e3, 4),
        "measured_seconds": burst_row.get("seconds"),
    }


def run_part2(check: Any, dry_run: bool, model_folder: Path) -> None:
    """Part 2's sub-steps, each guarded; the bf16 model is built once and serves every one up to the FP8 group,
    which builds its own once the bf16 one is freed."""
    from gpu_workload import write_model_folder

    args = workload(dry_run)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    plan = check.info["plan_s"] = plan_s(dry_run)
    hw = check.step("hardware", hardware, args, device) or {}
    check.set("hardware", hw)
    cfg = write_model_folder(args.preset, model_folder)
    check.set(
        "model",
        {
            "preset": args.preset,
            "dtype": "bfloat16" if device.type == "cuda" else "float32",
            "workload": {k: v for k, v in vars(args).items() if not k.startswith("hf_")},
            "peers": [w.name for w in peer_workloads(dry_run)],
        },
    )
    executor = check.step("build_cbserve", build_cbserve, args, model_folder, cfg, device, args.max_model_len)
    if executor is not None:
        serve_cfg = serve_config(args, model_folder, device, args.max_model_len)
        try:
            _steps(check, args, executor, hw)
            _burst(check, args, executor, serve_cfg)
            run_peers(check, executor, serve_cfg, cfg, hw, dry_run, reserve_after(plan, "peers"))
            _piecewise(check, args, executor, serve_cfg, reserve_after(plan, "piecewise"))
        finally:
            executor.shutdown()
            del executor
            release_memory(device)
    check.step("fp8", run_fp8, check, args, model_folder, cfg, hw, dry_run)  # its sub-steps guarded each


def _steps(check: Any, args: argparse.Namespace, executor: Any, hw: dict[str, Any]) -> None:
    """The decode rows and the prefill row."""
    runner = executor.runner
    model = dict(
        check.results["model"],
        backend=runner.backend_cls.name,
        num_blocks=executor.num_blocks,
        graphs=runner.graphs is not None,
        weight_gib=round(_weight_bytes(runner.model) / 2**30, 2),
        max_model_len=runner.max_model_len,
        cudagraph_mode=runner.config.cudagraph_mode,
    )
    check.set("model", model)
    bw = hw.get("copy_gb_s", 0) * 1e9 or 1e12
    rows, fraction, speedup = [], {}, {}
    for b in args.decode_batches:
        row = check.step(f"decode.b{b}", decode_row, runner, b, args.decode_context, bw, args.repeats, min_s=10)
        if row is None:
            continue
        rows.append(row)
        fraction[str(b)] = round(row["roofline_fraction"], 4)
        if row["graphs_speedup"] is not None:
            speedup[str(b)] = round(row["graphs_speedup"], 3)
        check.log(
            f"  decode b={b} ctx={row['context']}: eager {row['eager_ms']:.2f} ms, graph "
            f"{row['graph_ms'] or float('nan'):.2f} ms (medians of {args.repeats}), roofline "
            f"{row['roofline_ms']:.2f} ms ({row['roofline_fraction']:.0%})"
        )
        check.results.update(decode=rows, decode_roofline_fraction=fraction, graphs_speedup=speedup)
        check.save()
    pf = check.step(
        "prefill", prefill_roofline, args, runner, hw.get("gemm_tflops", 1.0) * 1e12, args.repeats, min_s=10
    )
    if pf is not None:
        check.set("prefill", pf)
        check.log(f"  prefill {pf['tokens']} tokens: {pf['step_ms']:.1f} ms, {pf['tflops']:.1f} TFLOP/s")


def _burst(check: Any, args: argparse.Namespace, executor: Any, serve_cfg: Any) -> None:
    """The burst as served (decode graphs only) and its ideal schedule."""
    got = check.step("e2e.cbserve", burst, check, args, executor, serve_cfg, "burst", 150.0, min_s=30)
    if got is not None:
        check.results.setdefault("e2e", {})["cbserve"] = got
        vocab = executor.runner.hf_config.vocab_size
        check.set("burst_schedule", schedule_fraction(args, check.results, vocab))
        frac = (check.results["burst_schedule"] or {}).get("fraction")
        check.log(
            f"  cbserve burst: {got['output_tok_s']:.0f} output tok/s ({got['seconds']:.1f} s"
            f"{', cut by its deadline' if got['partial'] else ''}), "
            f"{'nan' if frac is None else f'{frac:.0%}'} of its ideal schedule"
        )


def _piecewise(check: Any, args: argparse.Namespace, executor: Any, serve_cfg: Any, reserve_s: float) -> None:
    """Piecewise graphs captured on the runner: the mixed steps both ways, then the burst again replaying them
    (``cudagraph_mode: full_and_piecewise``) beside the burst as served; each sub-step only where it leaves
    ``reserve_s`` of the part's budget (the FP8 group's)."""
    runner = executor.runner
    captured = check.step("piecewise.capture", capture_piecewise, runner, min_s=reserve_s + 25)
    if captured is None:
        return
    pieces, seconds = captured
    check.set(
        "piecewise", {"buckets": len(pieces.sizes), "max_tokens": pieces.max_tokens, "capture_s": round(seconds, 1)}
    )
    rows, speedup = [], {}
    for decodes, chunk in args.mixed_steps:
        row = check.step(
            f"mixed.d{decodes}_c{chunk}",
            mixed_row,
            runner,
            pieces,
            decodes,
            args.decode_context,
            chunk,
            args.repeats,
            min_s=reserve_s + 5,
        )
        if row is not None:
            rows.append(row)
            speedup[f"{decodes}+{chunk}"] = round(row["piecewise_speedup"], 3)
            check.log(
                f"  mixed {decodes} decodes + {chunk}-token chunk: eager {row['eager_ms']:.2f} ms, "
                f"piecewise {row['piecewise_ms']:.2f} ms ({row['piecewise_speedup']:.2f}x)"
            )
            check.results.update(mixed=rows, piecewise_speedup=speedup)
            check.save()
    runner.piecewise = pieces  # the runner replays them for steps with prefill chunks, as full_and_piecewise does
    try:
        got = check.step(
            "e2e.cbserve_piecewise",
            burst,
            check,
            args,
            executor,
            serve_cfg,
            "burst_piecewise",
            reserve_s,
            min_s=reserve_s + 15,
        )
    finally:
        runner.piecewise = None
    if got is not None:
        check.results.setdefault("e2e", {})["cbserve_piecewise"] = got
        check.save()
        check.log(f"  cbserve burst with piecewise graphs: {got['output_tok_s']:.0f} output tok/s")
    del pieces
    release_memory(runner.device)
