"""The CPU attention backend: every query token attended by a C kernel over the paged cache (csrc/attention.c).

The kernel takes one query row at a time with its own block table and context length, and reads that
context's keys and values in place: no gather, no padding, no mask. A decode request is one such row. A
prefill chunk is one row per token: the token at position p attends to the cached keys 0..p, which is
causal attention, the chunk's own keys having been written to the cache first. So one kernel call covers
a whole step, decodes and prefill chunks alike (the model's one-call layer driver, ``../cpu/layers.py``,
relies on this). On a prefill step of 14 fresh prompts (1,097 tokens, SmolLM2's 9 query and 3 kv heads of
64) it took 2.2 ms a layer against 5.4 ms for the torch backend's per-request SDPA, on 2 cores. But each row
reads its whole context, so long contexts favour SDPA's blocked kernel (a 1,024-token prompt: a tie; 2,048:
68.6 vs 47.2 ms): a step with a prefill chunk of more than ``ROWS_MAX_SHORT_QUERY`` tokens whose context
exceeds ``ROWS_MAX_PREFILL_CONTEXT`` attends its prefill chunks with torch and only its decodes with the
kernel (and runs layer by layer). Short queries stay rows at any context: a speculative-decoding
verification (1 + k tokens) at a 1,000-token context took 24.4 ms a step on the torch/module path against
11-12 ms as rows in the one-call layer driver (SmolLM2, 2 cores).

Sliding windows and logit soft-capping (per layer, see ``backend.AttentionBackend``) are the kernel's own
arguments: a row reads only the blocks of its window.

Tensors other than float32 take the torch path, which stays the reference this one is tested against: the
backend's builder (``CpuMetadataBuilder``) sees from the model's layout (dtype, device) that they will, and
builds torch's plan for the step up front (``CpuPrepared.fallback``). The selector picks this backend for
``attention_backend="auto"`` on CPU when the kernels build (see ``../cpu/native.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbserve.worker.attention.backend import (
    AttentionLayout,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCache,
    PreparedAttention,
    write_kv_cache,
)
from cbserve.worker.attention.torch_backend import (
    TorchAttentionBackend,
    TorchMetadataBuilder,
    TorchPrepared,
    _prefill_chunks,
)
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.native import load_cpu_kernels

# Longest prefill context (tokens) attended as kernel rows; longer ones go to torch's SDPA (see above).
ROWS_MAX_PREFILL_CONTEXT = 768
# Queries of at most this many tokens are rows at any context (decodes, speculative verification).
ROWS_MAX_SHORT_QUERY = 16


@dataclass
class RowArgs:
    """Per query token (row of the flattened batch): its request's block table and its context length."""

    block_tables: torch.Tensor  # [num_tokens, max_blocks] int32
    seq_lens: torch.Tensor  # [num_tokens] int32: position of the token + 1
    max_seq_len: int


def decode_row_args(md: AttentionMetadata) -> RowArgs:
    """The rows of the decode requests alone (the first ``num_decodes``)."""
    nd = md.num_decodes
    return RowArgs(md.block_tables[:nd].to(torch.int32).contiguous(), md.seq_lens[:nd].to(torch.int32).contiguous(),
                   max(md.seq_lens_cpu[:nd], default=1))


def row_args(md: AttentionMetadata) -> RowArgs:
    """One row per query token: decode rows as they are, prefill chunks expanded token by token."""
    if md.num_decodes == md.num_reqs:  # decode only: rows are requests
        return decode_row_args(md)
    qlens = torch.tensor(md.query_lens_cpu, dtype=torch.long, device=md.block_tables.device)
    n = int(qlens.sum())
    starts = md.query_start_loc[:-1].long().repeat_interleave(qlens, output_size=n)
    ends = md.seq_lens.long().repeat_interleave(qlens, output_size=n)
    within = torch.arange(n, device=qlens.device) - starts  # index of the token inside its chunk
    seq = ends - qlens.repeat_interleave(qlens, output_size=n) + within + 1
    tables = md.block_tables.to(torch.int32).repeat_interleave(qlens, dim=0, output_size=n)
    return RowArgs(tables.contiguous(), seq.to(torch.int32).contiguous(), md.max_seq_len)


@dataclass
class CpuPrepared(PreparedAttention):
    """A step for the CPU backend: the kernel's rows, one per query token, or, when a prefill context is too
    long for rows, the decodes' rows alone and torch's plan for the prefill chunks (``prefill``).
    ``fallback`` is torch's plan for the whole step, built when the model's layers get tensors the kernel does
    not take (a layout that is not float32 on the CPU), else None."""

    rows: RowArgs
    prefill: TorchPrepared | None = None  # None: ``rows`` cover every token of the step
    fallback: TorchPrepared | None = None


def kernel_takes(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the C kernel attends tensors of ``dtype`` on ``device`` (float32 on the CPU); others take torch."""
    return dtype == torch.float32 and torch.device(device).type == "cpu"


class CpuMetadataBuilder(TorchMetadataBuilder):
    """Plans steps for the CPU backend: the kernel's rows, and torch's whole-step plan as well when the
    layout's tensors are not the kernel's (see ``kernel_takes``)."""

    def __init__(self, layout: AttentionLayout) -> None:
        super().__init__(layout)
        self.needs_fallback = not kernel_takes(layout.dtype, layout.device)

    def build(self, md: AttentionMetadata) -> CpuPrepared:
        fallback = super().build(md) if self.needs_fallback else None
        nd = md.num_decodes
        if all(q <= ROWS_MAX_SHORT_QUERY or s <= ROWS_MAX_PREFILL_CONTEXT
               for q, s in zip(md.query_lens_cpu[nd:], md.seq_lens_cpu[nd:], strict=True)):
            return CpuPrepared(row_args(md), fallback=fallback)
        # long prefill contexts: those chunks through torch's SDPA
        return CpuPrepared(decode_row_args(md), TorchPrepared([], _prefill_chunks(md), self.buffer), fallback)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    plan_type = CpuPrepared

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None,
        softcap: float | None = None, kernels: CpuKernels | None = None,
    ) -> None:
        """``kernels``: the model's build of the C kernels (its ``cpu_isa``); None: the CPU's best build."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap)
        self._kernels = kernels if kernels is not None else require_cpu_kernels()

    @classmethod
    def make_builder(cls, layout: AttentionLayout) -> AttentionMetadataBuilder:
        return CpuMetadataBuilder(layout)

    def attend(  # type: ignore[override]
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata,
        p: CpuPrepared,
    ) -> torch.Tensor:
        if not kernel_takes(q.dtype, q.device) or kv_cache[0].dtype != torch.float32:
            if p.fallback is None:
                raise RuntimeError(
                    f"attention backend 'cpu' got {q.dtype} tensors on {q.device} (KV cache {kv_cache[0].dtype}) but "
                    "the step's plan was built for a float32 CPU layout: build it with the builder of the model's "
                    "own AttentionLayout"
                )
            return super().attend(q, k, v, kv_cache, md, p.fallback)
        write_kv_cache(k, v, kv_cache, md.slot_mapping)
        rows = q if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.contiguous()
        out = torch.empty_like(rows)
        out_rows = out
        if p.prefill is not None:  # decodes on the kernel, prefill chunks on torch
            for chunk in p.prefill.prefill:
                self._prefill(q, k, v, kv_cache, chunk, out, p.prefill.buffer)
            rows, out_rows = rows[: md.num_decodes], out[: md.num_decodes]
        if rows.shape[0]:
            self._kernels.paged_decode(rows, out_rows, kv_cache[0], kv_cache[1], p.rows.block_tables,
                                       p.rows.seq_lens, p.rows.max_seq_len, self.scale, self.sliding_window,
                                       self.softcap)
        return out


def require_cpu_kernels() -> CpuKernels:
    """The loaded kernels, or ValueError saying why they are unavailable."""
    load = load_cpu_kernels()
    if load.kernels is None:
        raise ValueError(f"attention backend 'cpu' is not available: {load.reason}")
    return load.kernels
