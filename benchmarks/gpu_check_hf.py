"""The HF transformers baselines of ``gpu_check.py`` (part 1, once the kernel tests have freed the GPU), on the
random weights, prompts and output lengths of part 2's burst, each at the best HF offers on the card and
labelled with what it ran:
- static batching: ``generate`` with ``sdpa`` attention and its default dynamic cache, over fixed batches run
  to their longest output, at the batch size a short sweep finds fastest (each size's prefill and decode step
  timed, the burst's time predicted; no ``torch.compile``: compiling takes minutes);
- continuous batching: transformers' manager with the best attention available here (flash-attention 3 or 2
  where installed, else ``sdpa``; the kernels hub is out of reach), its own defaults for CUDA graphs and cache.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_workload import make_workload, random_weights, write_model_folder


def build_hf(cfg: Any, device: torch.device, seed: int) -> Any:
    """The HF model of ``cfg`` with ``sdpa`` attention, holding the seeded random weights cbserve gets (bf16 on
    CUDA, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, t in random_weights(cfg, device, dtype, seed):
            params[name].copy_(t)
    return model.eval()


def best_cb_attention() -> tuple[str, str]:
    """The attention transformers' continuous batching runs best with here, and why."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if is_flash_attn_3_available():
        return "flash_attention_3", "flash-attn 3 is installed"
    if is_flash_attn_2_available():
        return "flash_attention_2", "flash-attn 2 is installed"
    return "sdpa", "no flash-attn package here (and no network for the kernels hub): paged sdpa"


def _generate(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds of one ``generate`` over ``prompts`` (equal lengths: no padding), greedy, ``new_tokens`` each."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    gen = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def static_sweep(model: Any, args: argparse.Namespace, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    """Per batch size of ``args.hf_static_batches``: ``generate`` of ``a`` and ``b`` new tokens
    (``args.hf_sweep_tokens``) gives its decode step (the difference over ``b - a`` steps) and prefill; from them
    the burst's predicted time in batches of that size, each run to its longest output. The fastest size wins."""
    model.generation_config.eos_token_id = None
    a, b = args.hf_sweep_tokens
    _generate(model, prompts[:1], 2)  # cuBLAS, the allocator and the kernels' first calls: before any timing
    rows = []
    for size in args.hf_static_batches:
        batch = prompts[:size]
        short, long = _generate(model, batch, a), _generate(model, batch, b)
        step = max(long - short, 0.0) / (b - a)
        prefill = max(short - a * step, 0.0)
        predicted = sum(prefill + max(outs[i : i + size]) * step for i in range(0, len(outs), size))
        rows.append(
            {
                "batch": size,
                "prefill_s": prefill,
                "decode_step_ms": step * 1e3,
                "predicted_s": predicted,
                "predicted_output_tok_s": sum(outs) / predicted if predicted else None,
            }
        )
    best = min(rows, key=lambda r: r["predicted_s"])
    return {"rows": rows, "best_batch": best["batch"], "sweep_tokens": [a, b]}


def hf_static(model: Any, prompts: list[list[int]], outs: list[int], batch: int, deadline: float) -> dict[str, Any]:
    """``generate`` over batches of ``batch`` requests in arrival order, each run to its longest requested output
    (the tokens each request asked for count), stopped before a batch that would end past ``deadline``."""
    model.generation_config.eos_token_id = None
    tokens = finished = generated = 0
    t0 = last = time.perf_counter()
    for start in range(0, len(prompts), batch):
        now = time.perf_counter()
        if now + (now - last if start else 0.0) >= deadline:
            break
        last = now
        want = outs[start : start + batch]
        _generate(model, prompts[start : start + batch], max(want))
        generated += max(want) * len(want)
        tokens += sum(want)
        finished += len(want)
    seconds = time.perf_counter() - t0
    return {
        **_throughput(tokens, seconds, finished, len(prompts)),
        "generated_tokens": generated,
        "batch": batch,
        "label": {
            "attn_implementation": model.config._attn_implementation,
            "cache": "generate's default (DynamicCache)",
            "compile": False,
        },
    }


def _throughput(tokens: int, seconds: float, finished: int, requests: int) -> dict[str, Any]:
    """A baseline run's figures: output tokens over the seconds it ran, and whether every request finished."""
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "output_tok_s": tokens / max(seconds, 1e-9),
        "finished_requests": finished,
        "requests": requests,
        "partial": finished < requests,
    }


def _jsonable(obj: Any) -> dict[str, Any]:
    """The plain fields of a configuration object (what the record can hold)."""
    fields = vars(obj) if hasattr(obj, "__dict__") else {}
    return {
        k: v if not isinstance(v, tuple) else list(v)
        for k, v in fields.items()
        if isinstance(v, (bool, int, float, str, type(None), tuple, list)) and not k.startswith("_")
    }


def hf_continuous(
    model: Any, args: argparse.Namespace, prompts: list[list[int]], outs: list[int], deadline: float
) -> dict[str, Any]:
    """Every request added at once to transformers' continuous-batching manager (after its warm-up) running the
    best attention available (``best_cb_attention``); at ``deadline`` the manager is stopped hard and only
    finished requests' tokens count (the manager streams nothing back before a request finishes): ``partial``
    then says so."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    attention = best_cb_attention()
    if model.config._attn_implementation != attention[0]:
        model.set_attn_implementation(attention[0])
    gen = GenerationConfig(max_new_tokens=args.max_out, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=args.max_num_seqs,
        num_blocks=args.hf_num_blocks,
        max_batch_tokens=args.max_num_batched_tokens,
    )  # num_blocks None: from memory
    tokens = finished = 0
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, warmup=args.hf_warmup
    ) as manager:
        ran_with = model.config._attn_implementation
        resolved = _jsonable(getattr(manager, "continuous_batching_config", cb))
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
        seconds = time.perf_counter() - t0
        if finished < len(prompts):  # past the deadline: drop the rest rather than flush it
            manager.stop(block=True, timeout=30, hard_stop=True)
    return {
        **_throughput(tokens, seconds, finished, len(prompts)),
        "label": {
            "attn_implementation": ran_with,
            "chosen_because": attention[1],
            "warmup": args.hf_warmup,
            "config": resolved,
        },
    }


def hf_baselines(check: Any, args: argparse.Namespace, device: torch.device) -> None:
    """Both baselines as guarded sub-steps sharing one model, under ``hf`` in the record: the static sweep and
    run first, then continuous batching with at most what is left of the part's budget."""
    with tempfile.TemporaryDirectory(prefix="cbserve-gpu-check-hf-") as tmp:
        cfg = write_model_folder(args.preset, Path(tmp))
    prompts, outs = make_workload(args, cfg.vocab_size)
    model = check.step("hf.build", build_hf, cfg, device, args.seed, min_s=40 if device.type == "cuda" else 5)
    if model is None:
        return
    hf: dict[str, Any] = {"workload": "part 2's burst", "transformers_model": type(model).__name__}
    check.set("hf", hf)
    sweep = check.step("hf.static_sweep", static_sweep, model, args, prompts, outs, min_s=20)
    if sweep is not None:
        hf["static_sweep"] = sweep
        deadline = time.perf_counter() + max(5.0, min(90.0, (check.remaining() - 15) / 2))
        static = check.step("hf.static", hf_static, model, prompts, outs, sweep["best_batch"], deadline, min_s=15)
        if static is not None:
            hf["static"] = static
            check.set("hf", hf)
            check.log(
                f"  HF static batching (sdpa, batch {static['batch']}): {static['output_tok_s']:.0f} output "
                f"tok/s ({static['finished_requests']}/{static['requests']} requests)"
            )
    deadline = time.perf_counter() + max(5.0, min(150.0, check.remaining() - 10))
    cont = check.step("hf.continuous_batching", hf_continuous, model, args, prompts, outs, deadline, min_s=20)
    if cont is not None:
        hf["continuous_batching"] = cont
        check.set("hf", hf)
        check.log(
            f"  HF continuous batching ({cont['label']['attn_implementation']}): {cont['output_tok_s']:.0f} "
            f"output tok/s ({cont['finished_requests']}/{cont['requests']} requests)"
        )
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
