"""Memory profiling: how many bytes the KV cache may take on a CUDA device."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.attention.backend import KVCache
from cbserve.worker.config import ModelConfig
from cbserve.worker.cuda.piecewise_graphs import MAX_PIECEWISE_TOKENS
from cbserve.worker.runner.input_batch import CachedRequestState, PreparedBatch, build_batch
from cbserve.worker.sampling.sampler import Sampler, SamplingRow

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

    @property
    def sampler(self) -> Sampler: ...

    @property
    def config(self) -> ModelConfig: ...

    @property
    def lora(self) -> object | None: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def backend_cls(self) -> type: ...


# every row with each of the sampler's transforms and the most logprobs: its largest workspace (the float32
# logits and log-softmax, the top-p sort's values and indices, the float64 cumulative sums)
WORST_CASE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, presence_penalty=0.1,
                                   frequency_penalty=0.1, repetition_penalty=1.1, logprobs=20)


def graph_pool_tokens(runner: ProfiledRunner) -> int:
    """Tokens of the largest steps whose temporaries the CUDA-graph memory pools keep (captured after the KV
    cache is allocated, under the conditions ``maybe_capture_*`` apply): the decode graphs' largest batch,
    plus the piecewise graphs' largest token count (their own pool; what crosses pieces lives in buffers of a
    few MB outside it)."""
    if runner.config.enforce_eager or runner.lora is not None or getattr(runner.model, "cuda_graphs_blocker", None):
        return 0
    tokens = 0
    if getattr(runner.backend_cls, "supports_cuda_graphs", False):
        tokens += min(runner.max_num_seqs, runner.max_num_batched_tokens)
    if runner.config.cudagraph_mode == "full_and_piecewise":
        tokens += min(runner.max_num_batched_tokens, MAX_PIECEWISE_TOKENS)
    return tokens


def profile_sampler(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    """One sampling step over ``logits`` [rows, vocab] at the sampler's largest workspace; the packed result."""
    rows = [SamplingRow(WORST_CASE_PARAMS, list(range(8)), 4) for _ in range(logits.shape[0])]
    return sampler.sample(logits, rows)


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
    """Bytes left for the KV cache: total * utilization - (memory in use before profiling) - (the peak of a
    forward pass at max_num_batched_tokens with max_num_seqs logits rows and a worst-case sampling step over
    them) - (memory taken outside torch's allocator meanwhile) - (the CUDA graphs' pools, estimated)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use_before = total - free  # weights, CUDA context, other processes
    reserved_before = torch.cuda.memory_reserved(device)
    scratch_blocks = -(-min(runner.max_num_batched_tokens, runner.max_model_len) // runner.block_size)
    scratch = runner.allocate_kv_cache(scratch_blocks)  # a scratch cache: no graphs captured on it
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        batch = dummy_batch(runner, runner.max_num_batched_tokens, runner.max_num_seqs)
        logits = runner.forward_logits(batch, scratch)
        forward_peak = torch.cuda.max_memory_allocated(device) - allocated_before
        if logits is not None:
            profile_sampler(runner.sampler, logits)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - allocated_before
    # memory taken outside torch's allocator meanwhile: NCCL's buffers (first collectives), cuBLAS workspaces
    outside = max(0, free - torch.cuda.mem_get_info(device)[0] - (torch.cuda.memory_reserved(device) - reserved_before))
    del scratch, batch, logits
    torch.cuda.empty_cache()
    # the graphs' pools (one per kind): temporaries of their largest steps, in proportion to the profiled step's
    graphs = forward_peak * graph_pool_tokens(runner) / max(1, runner.max_num_batched_tokens)
    budget = int(total * gpu_memory_utilization - in_use_before - activation_peak - outside - graphs)
    logger.info("CUDA memory: total %.2f GiB, in use %.2f GiB, activation and sampling peak %.2f GiB, outside "
                "torch's allocator %.2f GiB, CUDA graphs ~%.2f GiB -> KV cache %.2f GiB", total / 2**30,
                in_use_before / 2**30, activation_peak / 2**30, outside / 2**30, graphs / 2**30, budget / 2**30)
    return budget
