"""Attention backend over the Triton paged kernels (the "auto" choice on CUDA).

Per layer and iteration: one K/V cache-write launch (padded slots ``< 0`` skipped), one split-KV decode
launch (+ merge) for the first ``num_decodes`` requests, one varlen prefill launch for the rest. An FP8 cache
(``kv_fp8.py``) is quantized by the write kernel and dequantized inside the attention kernels. The
prefill kernel reads query rows at absolute offsets ``query_start_loc[r]``, so the prefill part of the
batch needs no re-basing: it gets views of the metadata tensors past the decodes.

The split count of the decode kernel is a launch constant, part of the step's plan (``TritonMetadataBuilder``).
A CUDA-graph runner must fix it for the life of a captured graph: it sets ``metadata.decode_num_splits``
before the plan is built (see worker/cuda/graphs.py); otherwise it is chosen per iteration from the batch
size, the layout's kv heads, the device's SM count and the longest decode context, always one of
``triton_kernels.SPLIT_BUCKETS`` (1, 2, 4, 8, 16), so the kernel is compiled for at most five split counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbserve.worker.attention import triton_kernels
from cbserve.worker.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCache,
    PreparedAttention,
)
from cbserve.worker.attention.kv_fp8 import kv_scales

_DEFAULT_NUM_SMS = 132  # H100 SXM; only used for the split heuristic off-GPU (interpreter tests)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass
class TritonPrepared(PreparedAttention):
    """A step for the Triton kernels: the decode kernel's split count (None without decodes) and the longest
    prefill chunk (None without prefill chunks)."""

    num_splits: int | None
    prefill_max_q: int | None


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Plans steps for the Triton kernels: the decode split count (``md.decode_num_splits`` when set, else from
    the layout's kv heads and its device's SM count) and the longest prefill chunk."""

    def __init__(self, layout: AttentionLayout) -> None:
        super().__init__(layout)
        self.num_sms = num_sms(torch.device(layout.device))

    def build(self, md: AttentionMetadata) -> TritonPrepared:
        nd = md.num_decodes
        splits = md.decode_num_splits
        if nd and splits is None:
            max_decode_len = max(md.seq_lens_cpu[:nd]) if md.seq_lens_cpu else md.max_seq_len
            splits = triton_kernels.default_num_splits(nd, self.layout.num_kv_heads, max_decode_len, self.num_sms)
        max_q = None
        if md.seq_lens.shape[0] > nd:  # prefill chunks follow the decodes
            lens = md.query_lens_cpu[nd:]
            max_q = max(lens) if lens else md.max_query_len
        return TritonPrepared(splits if nd else None, max_q)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    plan_type = TritonPrepared
    supports_cuda_graphs = True  # decode launches are shape-stable given a fixed split count

    @classmethod
    def make_builder(cls, layout: AttentionLayout) -> AttentionMetadataBuilder:
        return TritonMetadataBuilder(layout)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata,
        p: TritonPrepared,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        scales = kv_scales(kv_cache)  # an FP8 cache's (kv_fp8.py), else None
        q = _last_dim_contiguous(q)
        triton_kernels.write_kv_cache(
            _last_dim_contiguous(k), _last_dim_contiguous(v), k_cache, v_cache, md.slot_mapping, scales
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = md.num_decodes
        if p.num_splits is not None:
            triton_kernels.decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                md.block_tables[:nd],
                md.seq_lens[:nd],
                p.num_splits,
                self.scale,
                out=out[:nd],
                window=self.sliding_window,
                softcap=self.softcap,
                kv_scales=scales,
            )
        if p.prefill_max_q is not None:
            triton_kernels.prefill_attention(
                q,
                k_cache,
                v_cache,
                md.block_tables[nd:],
                md.query_start_loc[nd:],
                md.seq_lens[nd:],
                p.prefill_max_q,
                self.scale,
                out=out,
                window=self.sliding_window,
                softcap=self.softcap,
                kv_scales=scales,
            )
        return out
