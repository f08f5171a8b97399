"""flash-attn backend: used when an importable ``vllm_flash_attn`` or ``flash_attn`` works with this torch.

Importing this module loads the library *and* runs a tiny paged call on the GPU checked against a torch
reference; if no candidate passes, the import raises ImportError (the selector then falls back). This
matters because wheels are built against one torch ABI: e.g. vllm-flash-attn 2.6.2 targets torch 2.4 and
fails to load (or misbehaves) on a current torch. Upstream flash-attn's paged path also restricts the page
size (multiples of 256 in 2.5/2.6), so the probe uses the engine's default block size of 16 and a library
that cannot do it is simply not used.

Decodes (the first ``num_decodes`` requests) go through ``flash_attn_with_kvcache`` (``cache_seqlens`` per
request; CUDA-graph safe, padded rows have ``cache_seqlens == 0``); prefill chunks through
``flash_attn_varlen_func`` with ``block_table`` (bottom-right-aligned causal mask: the query at position
``p`` sees keys ``0..p``). K/V are written with the Triton cache-write kernel (skips slot ``-1``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbserve.worker.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCache,
    PreparedAttention,
)

_CANDIDATES = ("vllm_flash_attn", "flash_attn")
_PROBE_BLOCK_SIZE = 16


@dataclass(frozen=True)
class FlashOps:
    module: str
    varlen: Callable[..., torch.Tensor]
    with_kvcache: Callable[..., torch.Tensor]


def _first(x: torch.Tensor | tuple) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x  # some versions return (out, lse)


def _probe(ops: FlashOps) -> None:
    """One decode and one prefix-continuation prefill over a 16-token-page cache vs SDPA; raises on error."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    bs, hq, hkv, d, ctx, ql = _PROBE_BLOCK_SIZE, 4, 2, 64, 21, 5
    n = ctx + ql
    k_cache = torch.randn(4, bs, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(4, bs, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=dev)
    q = torch.randn(ql, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    keys = k_cache[table[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None].float()
    vals = v_cache[table[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None].float()
    mask = torch.arange(n, device=dev)[None, :] <= torch.arange(ctx, n, device=dev)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), keys, vals, attn_mask=mask,
                                         enable_gqa=True)[0].transpose(0, 1)
    i32 = dict(dtype=torch.int32, device=dev)
    out = _first(ops.varlen(q=q, k=k_cache, v=v_cache, cu_seqlens_q=torch.tensor([0, ql], **i32),
                            cu_seqlens_k=torch.tensor([0, n], **i32), max_seqlen_q=ql, max_seqlen_k=n,
                            softmax_scale=d ** -0.5, causal=True, block_table=table))
    dec = _first(ops.with_kvcache(q[-1:][None], k_cache, v_cache, cache_seqlens=torch.tensor([n], **i32),
                                  block_table=table, softmax_scale=d ** -0.5, causal=True))[0]
    torch.cuda.synchronize(dev)
    err = max((out.float() - ref).abs().max().item(), (dec.float() - ref[-1:]).abs().max().item())
    if not err < 5e-2:
        raise RuntimeError(f"{ops.module}: probe mismatch (max abs error {err})")


def load_flash_ops() -> FlashOps:
    """The first candidate library that imports and passes the probe; ImportError when none does."""
    if not torch.cuda.is_available():
        raise ImportError("flash-attn backend needs a CUDA device")
    errors = []
    for name in _CANDIDATES:
        try:
            mod = importlib.import_module(name)
            ops = FlashOps(name, mod.flash_attn_varlen_func, mod.flash_attn_with_kvcache)
            _probe(ops)
            return ops
        except Exception as e:  # an ABI mismatch can surface as any error type: never crash the engine
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise ImportError("no usable flash-attn library: " + "; ".join(errors))


_OPS = load_flash_ops()  # evaluated once at import; the selector treats ImportError as "not available"


def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    from cbserve.worker.attention import triton_kernels  # triton ships with every CUDA build of torch

    triton_kernels.write_kv_cache(k if k.stride(-1) == 1 else k.contiguous(),
                                  v if v.stride(-1) == 1 else v.contiguous(), kv_cache[0], kv_cache[1],
                                  slot_mapping)


@dataclass
class FlashPrepared(PreparedAttention):
    """The prefill chunks of a step for ``flash_attn_varlen_func`` (all None without prefill chunks): query
    and key offsets (cumulative lengths) and the longest query and key."""

    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0


class FlashMetadataBuilder(AttentionMetadataBuilder):
    """Plans steps for flash-attn: the prefill chunks' offsets and longest query and key."""

    def build(self, md: AttentionMetadata) -> FlashPrepared:
        nd = md.num_decodes
        if md.seq_lens.shape[0] <= nd:
            return FlashPrepared()
        q_lens, s_lens = md.query_lens_cpu[nd:], md.seq_lens_cpu[nd:]
        return FlashPrepared(
            cu_q=md.query_start_loc[nd:] - nd,
            cu_k=F.pad(md.seq_lens[nd:].cumsum(0, dtype=torch.int32), (1, 0)),
            max_q=max(q_lens) if q_lens else md.max_query_len,
            max_k=max(s_lens) if s_lens else md.max_seq_len,
        )


class FlashAttentionBackend(AttentionBackend):
    name = "flash"
    plan_type = FlashPrepared
    supports_cuda_graphs = True

    @classmethod
    def make_builder(cls, layout: AttentionLayout) -> AttentionMetadataBuilder:
        return FlashMetadataBuilder(layout)

    def _window_softcap(self) -> dict[str, object]:
        """flash-attn's own arguments for this layer's sliding window (keys p - (W - 1)..p: ``window_size``
        (W - 1, 0)) and logit soft-cap; none without them (older versions lack ``softcap``)."""
        kw: dict[str, object] = {}
        if self.sliding_window is not None:
            kw["window_size"] = (self.sliding_window - 1, 0)
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        return kw

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata,
        p: FlashPrepared,
    ) -> torch.Tensor:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"flash-attn needs float16/bfloat16 activations, got {q.dtype}")
        _write_kv(k, v, kv_cache, md.slot_mapping)
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            o = _OPS.with_kvcache(q[:nd].unsqueeze(1), k_cache, v_cache, cache_seqlens=md.seq_lens[:nd],
                                  block_table=md.block_tables[:nd], softmax_scale=self.scale, causal=True,
                                  **self._window_softcap())
            out[:nd] = _first(o).squeeze(1)
        if p.cu_k is not None:
            o = _OPS.varlen(q=q[nd:], k=k_cache, v=v_cache, cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k,
                            max_seqlen_q=p.max_q, max_seqlen_k=p.max_k, softmax_scale=self.scale, causal=True,
                            block_table=md.block_tables[nd:], **self._window_softcap())
            out[nd:] = _first(o)
        return out
