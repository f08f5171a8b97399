"""The CPU attention backend: the torch backend with its decode attention done by a C kernel (csrc/attention.c).

Decode rows (one query token per request) are the bulk of a serving step's attention. The torch backend
gathers every request's cache blocks into a padded buffer and runs a masked SDPA over it: the cache is
read twice and written once, and the padding is computed. ``csrc/attention.c`` reads each request's blocks in
place, once for the scores and once for the values, with no padding and no mask. Prefill chunks (many
query tokens, where SDPA's blocked kernels pay off) stay on the torch path, and so does any dtype other
than float32.

The selector picks this backend for ``attention_backend="auto"`` on CPU when the kernels build
(see ``../cpu_native.py``); otherwise the torch backend, which stays the reference this one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cpu_kernels import CpuKernels
from ..cpu_native import load_cpu_kernels
from .backend import AttentionMetadata, KVCache
from .torch_backend import TorchAttentionBackend, _prefill_chunks


@dataclass
class _DecodeArgs:
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor  # [num_decodes] int32
    max_seq_len: int


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._kernels = require_cpu_kernels()

    def prepare(self, metadata: AttentionMetadata) -> None:
        # The torch decode groups are built only if a step falls back to them (see _attend_decodes).
        md, nd = metadata, metadata.num_decodes
        md.extras["torch_prefill"] = _prefill_chunks(md)
        md.extras["torch_buffer"] = self._buffer
        if nd:
            md.extras["cpu_decode"] = _DecodeArgs(
                md.block_tables[:nd].to(torch.int32).contiguous(),
                md.seq_lens[:nd].to(torch.int32).contiguous(),
                max(md.seq_lens_cpu[:nd]),
            )

    def _attend_decodes(self, q: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata, out: torch.Tensor) -> None:
        args: _DecodeArgs | None = md.extras.get("cpu_decode")
        if args is None or q.dtype != torch.float32 or q.device.type != "cpu":
            super()._attend_decodes(q, kv_cache, md, out)
            return
        nd = md.num_decodes
        qd = q[:nd] if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q[:nd].contiguous()
        self._kernels.paged_decode(
            qd, out[:nd], kv_cache[0], kv_cache[1], args.block_tables, args.seq_lens, args.max_seq_len, self.scale
        )


def require_cpu_kernels() -> CpuKernels:
    """The loaded kernels, or ValueError saying why they are unavailable."""
    load = load_cpu_kernels()
    if load.kernels is None:
        raise ValueError(f"attention backend 'cpu' is not available: {load.reason}")
    return load.kernels
