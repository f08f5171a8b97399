"""Shared helpers for the worker tests: tiny random HF models and an EngineCore driver."""

from __future__ import annotations

import socket
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from cbserve.scheduler import CacheConfig, EngineConfig, EngineCore, EngineRequest, SchedulerConfig
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.attention import AttentionBackend, AttentionLayout, AttentionMetadata
from cbserve.worker.attention.backend import PreparedAttention

VARIANTS = ("llama_gqa", "qwen2_bias", "llama3_tied", "llama_bf16_values")


def make_tiny_model(folder: Path, variant: str) -> Path:
    """Save a tiny random model (seeded, safetensors) of ``variant`` into ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234)
    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
    )
    if variant in ("llama_gqa", "llama_bf16_values"):
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common))
        if variant == "llama_bf16_values":  # float32 weights that are all bfloat16 values, as a bf16 checkpoint
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.bfloat16().float())
    elif variant == "qwen2_bias":
        cfg = Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0, **common)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random (non-zero) q/k/v biases so the bias path matters
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    elif variant == "llama3_tied":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cfg = LlamaConfig(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling=rope, **common)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(variant)
    model.eval()
    model.save_pretrained(folder)
    return folder


def hf_greedy(model: object, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers greedy continuation of one prompt (no padding), EOS ignored."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None  # type: ignore[attr-defined]  # never stop early
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)  # type: ignore
    return out[0, len(prompt) :].tolist()


@dataclass
class EngineRun:
    tokens: dict[str, dict[int, list[int]]] = field(default_factory=lambda: defaultdict(dict))
    logprobs: dict[str, dict[int, list]] = field(default_factory=lambda: defaultdict(dict))
    finish: dict[str, dict[int, str | None]] = field(default_factory=lambda: defaultdict(dict))
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    num_preemptions: int = 0
    prefix_hits: int = 0
    max_batch: int = 0
    steps: int = 0


def run_engine(
    executor: object, requests: list[tuple[str, list[int], SamplingParams]], *, block_size: int,
    num_blocks: int, max_num_batched_tokens: int = 64, max_num_seqs: int = 8, max_model_len: int = 256,
    join_at_step: dict[str, int] | None = None, check: bool = True, async_scheduling: bool = False,
) -> EngineRun:
    """Run requests through a real EngineCore; requests in ``join_at_step`` are added at that step.
    ``async_scheduling``: driven as the SchedulerActor drives it, step N+1 scheduled and executed before
    step N's output is applied."""
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, async_scheduling=async_scheduling),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
    )
    engine = EngineCore(config, executor)  # type: ignore[arg-type]
    join_at_step = join_at_step or {}
    pending = [r for r in requests if join_at_step.get(r[0], 0) > 0]
    for rid, prompt, params in requests:
        if join_at_step.get(rid, 0) == 0:
            engine.add_request(EngineRequest(rid, list(prompt), params, eos_token_id=2))
    run = EngineRun()
    while engine.has_work() or pending:
        for r in [r for r in pending if join_at_step[r[0]] <= run.steps]:
            engine.add_request(EngineRequest(r[0], list(r[1]), r[2], eos_token_id=2))
            pending.remove(r)
        run.steps += 1
        result = engine.step_with_batch_queue()  # one step in flight, or two with async scheduling
        if result is not None:
            _record(run, result)
        if check:
            engine.check_integrity()
        if run.steps > 10_000:
            raise RuntimeError("engine did not finish")
    return run


def _record(run: EngineRun, result: object) -> None:
    """Add one step's result to ``run``."""
    run.num_preemptions += result.scheduler_stats.num_preemptions
    run.prefix_hits += result.scheduler_stats.prefix_cache_hits
    run.max_batch = max(run.max_batch, result.scheduler_stats.batch_size)
    for o in result.outputs:
        run.tokens[o.req_id].setdefault(o.index, []).extend(o.new_token_ids)
        if o.new_logprobs:
            run.logprobs[o.req_id].setdefault(o.index, []).extend(o.new_logprobs)
        if o.prompt_logprobs is not None:
            assert o.req_id not in run.prompt_logprobs, "prompt logprobs are reported once"
            run.prompt_logprobs[o.req_id] = list(o.prompt_logprobs)
        if o.final_token_ids is not None:
            run.tokens[o.req_id][o.index] = list(o.final_token_ids)
        if o.finished:
            run.finish[o.req_id][o.index] = o.finish_reason


def paged_metadata(ctx_q: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator,
                   device: str = "cpu", pad_decodes: int = 0) -> AttentionMetadata:
    """Attention metadata of a decode-first batch over randomly placed cache blocks: one request per
    (cached context, query length) pair. ``pad_decodes`` appends CUDA-graph style padded decode rows
    (slot -1, seq_len 0) after the real decodes (only valid for decode-only batches)."""
    seq_lens = [c + q for c, q in ctx_q]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, used = [], [], 0
    for (ctx, _ql), sl in zip(ctx_q, seq_lens, strict=True):
        nb = -(-sl // block_size)
        blocks = perm[used:used + nb]
        used += nb
        tables.append(blocks + [0] * (max_blocks - nb))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx, sl)]
    q_lens = [q for _, q in ctx_q] + [1] * pad_decodes
    seq_lens += [0] * pad_decodes
    tables += [[0] * max_blocks] * pad_decodes
    slots += [-1] * pad_decodes
    num_decodes = sum(1 for q in q_lens if q == 1)
    if q_lens[:num_decodes] != [1] * num_decodes:
        raise ValueError("test batches must be decode-first")
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        query_start_loc=torch.tensor([0] + q_lens, **i32).cumsum(0).to(torch.int32),
        num_decodes=num_decodes,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )


def fused_qkv(num_tokens: int, hq: int, hkv: int, d: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v as views into one fused projection output, like the model produces (q is not contiguous)."""
    fused = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    q, k, v = fused.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d), v.reshape(num_tokens, hkv, d)


def build_plan(backend: AttentionBackend, md: AttentionMetadata, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> PreparedAttention:
    """Set ``md.prepared`` to the step's plan from ``backend``'s builder, for a model of its heads whose
    activations and KV cache are ``dtype`` on ``device``, as the model runner does each step."""
    layout = AttentionLayout(backend.num_heads, backend.num_kv_heads, backend.head_dim, dtype, torch.device(device))
    md.prepared = type(backend).make_builder(layout).build(md)
    return md.prepared


def interpreted_triton(*modules: ModuleType, probe: str) -> None:
    """Without CUDA, make ``modules`` run under the Triton interpreter (conftest.py sets TRITON_INTERPRET=1 before
    triton is first imported): skip if triton itself was imported without it, else re-import the modules, in
    order, when their kernel ``probe`` (of the last module) was decorated before the interpreter was on."""
    import importlib

    import pytest
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    if not isinstance(getattr(modules[-1], probe), InterpretedFunction):
        for module in modules:
            importlib.reload(module)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_group(finished: bool) -> None:
    """Tear a test's gloo group down. After a normal end both ranks meet first: a rank whose peer has already closed
    the group while its last receive was still under way aborts ("terminate called without an active exception")."""
    import torch.distributed as dist

    if finished:
        dist.barrier()
    dist.destroy_process_group()


def follow_rank0(run_step: Callable[[Any], None]) -> None:
    """Rank 1 of a test's group: ``run_step`` each step rank 0 broadcasts, until it broadcasts None."""
    import torch.distributed as dist

    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        run_step(box[0])
