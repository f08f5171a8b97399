"""Part 2's FP8 group, run last, once the bf16 model is freed: the same Llama-3.1-8B-shaped model built again with
``quantization="fp8"`` and ``kv_cache_dtype="fp8"`` (the same seeded random bf16 weights, quantized to e4m3 as
they are loaded, a scale per output channel; e4m3 KV blocks with a scale per token and head), then:

- decode steps at batch 1 and 64 (``gpu_check_steps.decode_row``: CUDA graphs and eagerly, medians of
  interleaved repeats, the same rows and context as bf16's);
- the concurrency-250 1000/1000 workload for its window only (``gpu_check_peers.WINDOW_S``: the same requests as
  the bf16 run, stopped at the first step past the window: partial by design), whose output tokens/s the goal
  compares with the bf16 run's over the same first seconds (``gpu_check_engine.window_figures`` for both);
- greedy agreement with bf16 and the KL of next-token distributions (``bench_fp8_accuracy.measure``) on the same
  random weights, a few prompts of random token ids (the models it builds run eagerly, one at a time).

On a GPU below compute capability 8.9 the engine refuses FP8: the group records ``refused: <the engine's
reason>`` and the FP8 goals read "not measurable". On the CPU (a dry run) every step runs on the emulation.
``gpu_check_goals.fp8_vs_bf16`` sets the figures against bf16's."""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_goals import FP8_ACCURACY_VARIANT, WINDOW_WORKLOAD
from gpu_check_peers import WINDOW_S, Window, peer_workloads, run_peer, window_text
from gpu_check_steps import decode_row, release_memory
from gpu_rooflines import _weight_bytes
from gpu_workload import build_cbserve, random_weights, serve_config

SETTINGS = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
DECODE_BATCHES = {False: (1, 64), True: (1, 4)}
# (prompts, prompt tokens, greedy tokens) of the accuracy measurement
ACCURACY = {False: (8, 64, 32), True: (2, 8, 4)}


def plan_s(dry_run: bool) -> dict[str, float]:
    """The group's seconds on the GPU (a dry run: a few each): the build (the bf16 model freed first; the FP8
    kernels' first compilation), two decode rows, the window with the run's warm-up, abort and timeline around it,
    and the accuracy measurement's two eager builds and short runs."""
    if dry_run:
        return {"build": 3.0, "decode": 2.0, "c250_window": 3.0, "accuracy": 3.0}
    return {"build": 15.0, "decode": 4.0, "c250_window": WINDOW_S[False] + 9.0, "accuracy": 12.0}


def refusal(device: torch.device) -> str | None:
    """Why the engine refuses these settings on ``device``, as "refused: <its reason>" (its own check, as a build
    makes it), else None (on the CPU: the emulation runs)."""
    from cbserve.worker import fp8

    if fp8.fp8_device_problem(device) is None:
        return None
    try:
        fp8.check_fp8_device(device, ", ".join(f"{k}={v!r}" for k, v in SETTINGS.items()))
    except ValueError as e:
        return f"refused: {e}"
    return None


def run_fp8(check: Any, args: argparse.Namespace, folder: Path, cfg: Any, hw: dict[str, Any], dry_run: bool) -> None:
    """The group's sub-steps, each guarded (a failure is recorded and the next runs), ``fp8`` saved after each."""
    device = torch.device(args.device)
    plan = plan_s(dry_run)
    record: dict[str, Any] = {"settings": SETTINGS, "window_s": WINDOW_S[dry_run], "plan_s": plan}
    refused = refusal(device)
    if refused is not None:
        check.set("fp8", {**record, "refused": refused})
        check.log(f"  FP8 {refused}")
        return
    check.set("fp8", record)
    executor = check.step(
        "fp8.build",
        build_cbserve,
        args,
        folder,
        cfg,
        device,
        args.max_model_len,
        **SETTINGS,
        min_s=plan["build"] + plan["decode"],
    )
    if executor is not None:
        try:
            check.step("fp8.model", _describe, check, executor)
            _decode(check, executor, args, hw, dry_run)
            check.step(
                "fp8.c250_window",
                window_run,
                check,
                executor,
                args,
                folder,
                cfg,
                hw,
                dry_run,
                min_s=plan["c250_window"],
            )
        finally:
            executor.shutdown()
            del executor
            release_memory(device)
    got = check.step("fp8.accuracy", accuracy, args, folder, cfg, device, dry_run, min_s=plan["accuracy"])
    if got is not None:
        check.results["fp8"]["accuracy"] = got
        check.save()
        r = got["results"][FP8_ACCURACY_VARIANT]
        check.log(
            f"  FP8 accuracy ({got['model']}): greedy agreement {r['greedy_prefix_agreement']:.3f}, "
            f"{r['identical_sequences']}/{got['prompts']} identical, top-1 {r['top1_agreement']:.3f}, "
            f"mean KL {r['mean_kl']:.5f}"
        )


def _describe(check: Any, executor: Any) -> None:
    """What the FP8 model was built with: attention backend, KV blocks and their bytes, graphs, weight bytes."""
    runner = executor.runner
    check.results["fp8"]["model"] = {
        "backend": runner.backend_cls.name,
        "num_blocks": executor.num_blocks,
        "block_bytes": runner.block_bytes(),
        "graphs": runner.graphs is not None,
        "weight_gib": round(_weight_bytes(runner.model) / 2**30, 2),
    }
    check.save()


def _decode(check: Any, executor: Any, args: argparse.Namespace, hw: dict[str, Any], dry_run: bool) -> None:
    """Decode rows at batch 1 and 64 as bf16's are timed, each against bf16's row of the same batch."""
    bw = hw.get("copy_gb_s", 0) * 1e9 or 1e12
    rows = check.results["fp8"].setdefault("decode", [])
    bf16 = {r["batch"]: r for r in check.results.get("decode") or []}
    for b in DECODE_BATCHES[dry_run]:
        row = check.step(
            f"fp8.decode.b{b}", decode_row, executor.runner, b, args.decode_context, bw, args.repeats, min_s=2
        )
        if row is None:
            continue
        rows.append(row)
        check.save()
        served = row["graph_ms"] or row["eager_ms"]
        base = bf16.get(b) or {}
        base_ms = base.get("graph_ms") or base.get("eager_ms")
        check.log(
            f"  FP8 decode b={b} ctx={row['context']}: eager {row['eager_ms']:.2f} ms, graph "
            f"{row['graph_ms'] or float('nan'):.2f} ms, roofline {row['roofline_ms']:.2f} ms"
            + (f"; {served / base_ms:.2f}x bf16's {base_ms:.2f} ms" if base_ms else "")
        )


def window_run(
    check: Any, executor: Any, args: argparse.Namespace, folder: Path, cfg: Any, hw: dict[str, Any], dry_run: bool
) -> dict[str, Any]:
    """The concurrency-250 workload's requests in FP8, stopped at the first step past its window; its row goes to
    ``fp8.peers.<name>`` (``window`` holds the figure the goal compares)."""
    serve_cfg = serve_config(args, folder, executor.runner.device, args.max_model_len, **SETTINGS)
    w = next(w for w in peer_workloads(dry_run) if w.name == WINDOW_WORKLOAD)
    seconds = WINDOW_S[dry_run]
    w = dataclasses.replace(
        w,
        cap_s=seconds,
        published=(),
        how=f"the same requests in FP8 for the first {seconds:g} s (partial by design), against the bf16 run's "
        "first seconds",
    )
    deadline = time.perf_counter() + seconds + plan_s(dry_run)["c250_window"]  # the window ends the run first
    row = run_peer(check, w, executor, serve_cfg, cfg, hw, deadline, Window(seconds, stop=True), ("fp8", "peers"))
    check.log(f"  FP8 {w.name}: {window_text(row['window'])}")
    return row


def accuracy(args: argparse.Namespace, folder: Path, cfg: Any, device: torch.device, dry_run: bool) -> dict[str, Any]:
    """``bench_fp8_accuracy.measure`` on the part's model (its random weights, the same seed): bf16 against FP8
    weights and KV cache on a few prompts of random token ids, each model built eagerly with the blocks it needs."""
    from bench_fp8_accuracy import VARIANTS, measure

    n, prompt_len, max_tokens = ACCURACY[dry_run]
    mc = serve_config(args, folder, device, args.max_model_len).worker_model_config()
    fields = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc) if f.init}
    fields["enforce_eager"] = True  # the same kernels without a graph capture per model
    rng = random.Random(f"{args.seed}-fp8-accuracy")
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(n)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = measure(
        fields,
        prompts,
        max_tokens,
        weights=lambda: random_weights(cfg, device, dtype, args.seed),
        variants={FP8_ACCURACY_VARIANT: VARIANTS[FP8_ACCURACY_VARIANT]},
    )
    return {
        "model": f"{args.preset}, the part's random {str(dtype).removeprefix('torch.')} weights (seed {args.seed})",
        "prompts": n,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "variant": {FP8_ACCURACY_VARIANT: VARIANTS[FP8_ACCURACY_VARIANT]},
        "results": results,
    }
