"""The HF transformers baselines of ``gpu_check.py`` part 2, on the same random weights, prompts and output
lengths as cbserve's burst: transformers' continuous-batching manager (as bench_gpu's run_hf_e2e, with a
deadline) and static batching (``generate`` over fixed batches, each run to its longest output)."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
from gpu_check_speed import rates
from gpu_workload import random_weights


def build_hf(cfg: Any, device: torch.device, seed: int) -> Any:
    """The HF model of ``cfg`` holding the seeded random weights cbserve got (bf16 on CUDA, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, t in random_weights(cfg, device, dtype, seed):
            params[name].copy_(t)
    return model.eval()


def hf_continuous(model: Any, args: argparse.Namespace, prompts: list[list[int]], outs: list[int],
                  deadline: float) -> dict[str, Any]:
    """Every request added at once to transformers' continuous-batching manager (after its warm-up); at
    ``deadline`` the manager is stopped hard and the finished requests' tokens count."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=args.max_out, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.max_num_seqs, num_blocks=args.hf_num_blocks,
                                  max_batch_tokens=args.max_num_batched_tokens)  # num_blocks None: from memory
    tokens = finished = 0
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=30, warmup=args.hf_warmup) as manager:
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        while finished < len(prompts) and time.perf_counter() < deadline:
            res = manager.get_result(timeout=max(0.1, min(5.0, deadline - time.perf_counter())))
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous-batching thread stopped")
                continue
            if res.is_finished():
                if res.error:
                    raise RuntimeError(f"HF request {res.request_id}: {res.error}")
                finished += 1
                tokens += len(res.generated_tokens)
        elapsed = time.perf_counter() - t0
        if finished < len(prompts):  # past the deadline: drop the rest rather than flush it
            manager.stop(block=True, timeout=30, hard_stop=True)
    return rates(tokens, elapsed, finished, len(prompts))


def hf_static(model: Any, args: argparse.Namespace, prompts: list[list[int]], outs: list[int],
              deadline: float) -> dict[str, Any]:
    """``generate`` over batches of ``hf_static_batch`` requests in arrival order (equal prompt lengths: no
    padding), each batch run to its longest requested output; the tokens each request asked for count."""
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    device = next(model.parameters()).device
    tokens = finished = generated = 0
    t0 = last = time.perf_counter()
    for start in range(0, len(prompts), args.hf_static_batch):
        now = time.perf_counter()
        if now + (now - last if start else 0.0) >= deadline:  # the next batch would end past the deadline
            break
        last = now
        ids = torch.tensor(prompts[start:start + args.hf_static_batch], device=device)
        want = outs[start:start + args.hf_static_batch]
        gen = GenerationConfig(max_new_tokens=max(want), do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        tokens += sum(want)
        finished += len(want)
    return {**rates(tokens, time.perf_counter() - t0, finished, len(prompts)), "generated_tokens": generated,
            "batch": args.hf_static_batch}


def hf_baselines(check: Any, args: argparse.Namespace, cfg: Any, device: torch.device, prompts: list[list[int]],
                 outs: list[int]) -> None:
    """Both baselines as guarded sub-steps sharing one model; the continuous-batching run gets at most half of
    what is left of the part's budget (static batching the rest)."""
    model = check.step("hf.build", build_hf, cfg, device, args.seed, min_s=40)
    if model is None:
        return
    e2e = check.results.setdefault("e2e", {})
    throughput = dict(check.results.get("throughput") or {})
    cb_deadline = time.perf_counter() + min(100.0, max(5.0, (check.remaining() - 15) / 2))
    cont = check.step("e2e.hf_continuous_batching", hf_continuous, model, args, prompts, outs, cb_deadline, min_s=20)
    if cont is not None:
        e2e["hf_continuous_batching"] = cont
        throughput["hf_continuous_batching"] = cont["output_tok_s"]
        check.set("throughput", throughput)
        check.log(f"  HF continuous batching: {cont['output_tok_s']:.0f} output tok/s "
                  f"({cont['finished_requests']}/{cont['requests']} requests)")
    gc.collect()  # the manager's KV cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    static_deadline = time.perf_counter() + max(5.0, check.remaining() - 15)
    static = check.step("e2e.hf_static", hf_static, model, args, prompts, outs, static_deadline, min_s=20)
    if static is not None:
        e2e["hf_static"] = static
        throughput["hf_static"] = static["output_tok_s"]
        check.set("throughput", throughput)
        check.log(f"  HF static batching: {static['output_tok_s']:.0f} output tok/s "
                  f"({static['finished_requests']}/{static['requests']} requests)")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
