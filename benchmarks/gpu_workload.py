"""The workload of ``bench_gpu.py``: a Llama-shaped config with seeded random weights (nothing downloaded),
random prompts, and the two end-to-end runs: cbserve (EngineCore + LocalExecutor, in-process) and HF
transformers' continuous-batching manager, fed the very same tensors and requests."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
}


def write_model_folder(preset: str, folder: Path) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**PRESETS[preset], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.save_pretrained(folder)
    return cfg


def random_weights(cfg: Any, device: torch.device, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
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
        for name, shape in (
            ("self_attn.q_proj", (q, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, q)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ):
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


def serve_config(
    args: argparse.Namespace, folder: Path, device: torch.device, max_model_len: int | None = None, **overrides: Any
) -> Any:
    """The ``CBServeConfig`` of cbserve on the random model in ``folder`` (``args``: the workload's engine limits;
    ``max_model_len``: prompt_len + max_out unless given), as ``LLM(**fields)`` would build it: its engine and
    worker configurations are the served ones. No prefix caching: random prompts share nothing. ``overrides``:
    other fields of the configuration (``quantization="fp8"``, ``kv_cache_dtype="fp8"``)."""
    from cbserve.config import CBServeConfig

    return CBServeConfig(
        model=str(folder),
        dtype="bfloat16" if device.type == "cuda" else "float32",
        device=device.type,
        max_model_len=max_model_len or args.prompt_len + args.max_out,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=1 << 28,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        block_size=16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        seed=args.seed,
        **overrides,
    )


def build_cbserve(
    args: argparse.Namespace,
    folder: Path,
    cfg: Any,
    device: torch.device,
    max_model_len: int | None = None,
    **overrides: Any,
) -> Any:
    """A ``LocalExecutor`` of ``serve_config``'s worker configuration (with ``overrides``) over the seeded random
    weights of ``cfg`` (in the model's dtype: ``quantization="fp8"`` quantizes them as they are loaded)."""
    from cbserve.worker.runner.executor import LocalExecutor

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mc = serve_config(args, folder, device, max_model_len, **overrides).worker_model_config()
    return LocalExecutor(mc, progress=False, weights=random_weights(cfg, device, dtype, args.seed))


def run_cbserve_e2e(
    args: argparse.Namespace, executor: Any, prompts: list[list[int]], outs: list[int]
) -> dict[str, float]:
    from cbserve.scheduler.config import CacheConfig, EngineConfig, SchedulerConfig
    from cbserve.scheduler.engine_core import EngineCore
    from cbserve.scheduler.requests.request import EngineRequest
    from cbserve.scheduler.requests.sampling_params import SamplingParams

    sched = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.prompt_len + args.max_out,
    )
    config = EngineConfig(
        scheduler=sched, cache=CacheConfig(block_size=16, num_blocks=executor.num_blocks, enable_prefix_caching=False)
    )
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
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "total_tok_s": (tokens + sum(map(len, prompts))) / elapsed,
        "steps": steps,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else float("nan"),
    }


def run_hf_e2e(
    args: argparse.Namespace, cfg: Any, device: torch.device, prompts: list[list[int]], outs: list[int]
) -> dict[str, float]:
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
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=args.max_num_seqs, max_batch_tokens=args.max_num_batched_tokens
    )
    t0 = time.perf_counter()
    tokens, first = 0, []
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
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
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "total_tok_s": (tokens + sum(map(len, prompts))) / elapsed,
    }
