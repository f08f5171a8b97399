"""Memory profiling: how many bytes the KV cache may take on a CUDA device."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from cbserve.scheduler.sampling_params import SamplingParams

from .attention.backend import KVCache
from .input_batch import CachedRequestState, PreparedBatch, build_batch

logger = logging.getLogger(__name__)


class ProfiledRunner(Protocol):
    """What profiling needs of the model runner (model_runner.ModelRunner)."""

    device: torch.device
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int

    def allocate_kv_cache(self, num_blocks: int) -> list[KVCache]: ...

    def forward_logits(self, batch: PreparedBatch, kv_caches: list[KVCache]) -> torch.Tensor | None: ...


def dummy_batch(runner: ProfiledRunner, num_tokens: int, num_logits: int) -> PreparedBatch:
    """Prefill chunks of up to max_model_len tokens covering ``num_tokens``, all writing to block 0..;
    the runner's KV cache must hold at least ceil(max chunk / block_size) blocks."""
    chunk = min(num_tokens, runner.max_model_len)
    nblocks = -(-chunk // runner.block_size)
    states, sched = [], {}
    left = num_tokens
    while left > 0:
        n = min(chunk, left)
        rid = f"profile-{len(states)}"
        states.append(CachedRequestState(rid, [0] * n, n, SamplingParams(), list(range(nblocks)), 0))
        sched[rid] = n
        left -= n
    batch = build_batch(states, sched, runner.block_size, runner.device)
    rows = batch.logits_rows
    if num_logits > rows.numel():  # profile the LM head at max_num_seqs rows
        batch.logits_rows = torch.zeros(num_logits, dtype=torch.long, device=runner.device)
    return batch


def profile_cuda_kv_budget(runner: ProfiledRunner, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache: total * utilization - (memory in use before profiling) - (activation
    peak of a forward pass at max_num_batched_tokens with max_num_seqs logits rows)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use_before = total - free  # weights, CUDA context, other processes
    scratch_blocks = -(-min(runner.max_num_batched_tokens, runner.max_model_len) // runner.block_size)
    scratch = runner.allocate_kv_cache(scratch_blocks)  # a scratch cache: no graphs captured on it
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        batch = dummy_batch(runner, runner.max_num_batched_tokens, runner.max_num_seqs)
        logits = runner.forward_logits(batch, scratch)
        if logits is not None:
            torch.softmax(logits.float(), dim=-1)  # the sampler's float32 copy of the logits
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - allocated_before
    del scratch, batch, logits
    torch.cuda.empty_cache()
    budget = int(total * gpu_memory_utilization) - in_use_before - activation_peak
    logger.info(
        "CUDA memory: total %.2f GiB, in use %.2f GiB, activation peak %.2f GiB -> KV cache %.2f GiB",
        total / 2**30,
        in_use_before / 2**30,
        activation_peak / 2**30,
        budget / 2**30,
    )
    return budget
