"""The CPU attention backend: every query token attended by a C kernel over the paged cache (csrc/attention.c).

The kernel takes one query row at a time with its own block table and context length, and reads that
context's keys and values in place: no gather, no padding, no mask. A decode request is one such row. A
prefill chunk is one row per token: the token at position p attends to the cached keys 0..p, which is
causal attention, the chunk's own keys having been written to the cache first. So one kernel call covers
a whole step, decodes and prefill chunks alike (the model's one-call layer driver, ``../cpu_layers.py``,
relies on this). On a prefill step of 14 fresh prompts (1,097 tokens, SmolLM2's 9 query and 3 kv heads of
64) it took 2.2 ms a layer against 5.4 ms for the torch backend's per-request SDPA, on 2 cores. But each row
reads its whole context, so long contexts favour SDPA's blocked kernel (a 1,024-token prompt: a tie; 2,048:
68.6 vs 47.2 ms): a step with a prefill chunk whose context exceeds ``ROWS_MAX_PREFILL_CONTEXT`` attends its
prefill chunks with torch and only its decodes with the kernel (and runs layer by layer).

Tensors other than float32 take the torch path, which stays the reference this one is tested against. The
selector picks this backend for ``attention_backend="auto"`` on CPU when the kernels build (see
``../cpu_native.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cpu_kernels import CpuKernels
from ..cpu_native import load_cpu_kernels
from .backend import AttentionMetadata, KVCache, write_kv_cache
from .torch_backend import TorchAttentionBackend, _prefill_chunks

# Longest prefill context (tokens) attended as kernel rows; longer ones go to torch's SDPA (see above).
ROWS_MAX_PREFILL_CONTEXT = 768


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


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._kernels = require_cpu_kernels()

    def prepare(self, metadata: AttentionMetadata) -> None:
        md = metadata
        if max(md.seq_lens_cpu[md.num_decodes:], default=0) <= ROWS_MAX_PREFILL_CONTEXT:
            md.extras["cpu_rows"] = row_args(md)
        else:  # long prefill contexts: those chunks through torch's SDPA
            md.extras["cpu_decode_rows"] = decode_row_args(md)
            md.extras["torch_prefill"] = _prefill_chunks(md)
            md.extras["torch_buffer"] = self._buffer

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        md = metadata
        if q.dtype != torch.float32 or q.device.type != "cpu" or kv_cache[0].dtype != torch.float32:
            if "torch_decode" not in md.extras:
                TorchAttentionBackend.prepare(self, md)
            return super().forward(q, k, v, kv_cache, md)
        if "cpu_rows" not in md.extras and "cpu_decode_rows" not in md.extras:
            self.prepare(md)
        write_kv_cache(k, v, kv_cache, md.slot_mapping)
        rows = q if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.contiguous()
        out = torch.empty_like(rows)
        args: RowArgs | None = md.extras.get("cpu_rows")
        if args is None:  # decodes on the kernel, prefill chunks on torch
            args = md.extras["cpu_decode_rows"]
            for chunk in md.extras["torch_prefill"]:
                self._prefill(q, k, v, kv_cache, chunk, out, md.extras["torch_buffer"])
            rows, out_rows = rows[: md.num_decodes], out[: md.num_decodes]
        else:
            out_rows = out
        if rows.shape[0]:
            self._kernels.paged_decode(rows, out_rows, kv_cache[0], kv_cache[1], args.block_tables, args.seq_lens,
                                       args.max_seq_len, self.scale)
        return out


def require_cpu_kernels() -> CpuKernels:
    """The loaded kernels, or ValueError saying why they are unavailable."""
    load = load_cpu_kernels()
    if load.kernels is None:
        raise ValueError(f"attention backend 'cpu' is not available: {load.reason}")
    return load.kernels
