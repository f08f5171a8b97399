"""Reference attention in plain torch, correct on CPU and CUDA; the backend CPU users run.

Decode requests (one query token each) are attended together: their cache blocks are gathered into one
padded [num_decodes, max_len, kv_heads, head_dim] tensor and a single masked SDPA call covers them all
(grouped by context length so little padding is gathered). Prefill chunks are attended one request at a
time, straight from this step's keys when the chunk starts the sequence, else from the cache. An FP8 cache
(``kv_fp8.py``) is always read back, dequantized into the model's dtype: the reference of the Triton kernels'
FP8 path, and on CPU its emulation.

A layer with a sliding window masks the keys before its window (per step and window, the masks are made once
and shared by the layers with that window); one with logit soft-capping runs the eager form HF Gemma 2 runs
(``softcapped_attention``) instead of SDPA.

Blocks are gathered with ``index_select`` into one scratch buffer reused by every layer and every step:
a fresh gather result per layer cost more in allocation and page faults than the copy itself (B=64 decode
requests with 300-token contexts: 10.6 ms per layer with ``cache[block_table]``, 7.0 ms with the buffer).
The buffer belongs to the backend's metadata builder (``TorchMetadataBuilder``, one per model runner), whose
plans lend it to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cbserve.worker.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCache,
    PreparedAttention,
    write_kv_cache,
)
from cbserve.worker.attention.kv_fp8 import Fp8KVCache, gather_fp8

# Decode requests are split into groups of similar context length when that saves this much padding.
_MIN_GROUP = 8


class _GatherBuffer:
    """Scratch K and V buffers, grown on demand, that paged blocks are gathered into."""

    def __init__(self) -> None:
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather(self, kv_cache: KVCache, blocks: torch.Tensor,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` (1-D int64 block ids), as [len(blocks), block_size, kv_heads, head_dim]; an FP8
        cache's dequantized to ``dtype`` (default float32; new tensors: the emulation's)."""
        if isinstance(kv_cache, Fp8KVCache):
            return gather_fp8(kv_cache, blocks, dtype or torch.float32)
        k_cache, v_cache = kv_cache
        n = blocks.numel()
        if self._kv is None or not _fits(self._kv[0], k_cache, n):
            k = torch.empty((n, *k_cache.shape[1:]), dtype=k_cache.dtype, device=k_cache.device)
            self._kv = (k, torch.empty_like(k))
        k, v = self._kv[0][:n], self._kv[1][:n]
        torch.index_select(k_cache, 0, blocks, out=k)
        torch.index_select(v_cache, 0, blocks, out=v)
        return k, v


def _fits(buffer: torch.Tensor, cache: torch.Tensor, n: int) -> bool:
    return (
        buffer.shape[0] >= n
        and buffer.shape[1:] == cache.shape[1:]
        and buffer.dtype == cache.dtype
        and buffer.device == cache.device
    )


@dataclass
class _DecodeGroup:
    rows: slice | torch.Tensor  # rows of the flattened batch (a slice when contiguous)
    block_table: torch.Tensor  # [n, max_blocks] int64
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] bool, None when no padding
    seq_lens: torch.Tensor  # [n] context lengths
    padded_len: int  # max_blocks * block_size: the keys gathered per request
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask (made once)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer attending to the last ``window`` keys (None: all of them)."""
        if window is None or window >= self.padded_len:
            return self.mask
        if window not in self.windowed:
            pos = torch.arange(self.padded_len, device=self.seq_lens.device)[None, :]
            seq = self.seq_lens[:, None]
            keep = (pos < seq) & (pos >= seq - window)
            self.windowed[window] = keep.view(len(self.seq_lens), 1, 1, -1)
        return self.windowed[window]


@dataclass
class _PrefillChunk:
    start: int
    end: int
    blocks: torch.Tensor  # int64 block ids of the request's keys and values
    from_cache: bool  # the chunk continues a sequence: its context is read from the cache (else this step's k/v)
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None means plain causal
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask (made once)

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The mask of a layer whose query at position p sees keys p - window + 1..p (None: causal)."""
        q_len = self.end - self.start
        if window is None or window >= self.seq_len:  # no query reaches back further than the window
            return self.mask
        if window not in self.windowed:
            qpos = torch.arange(self.seq_len - q_len, self.seq_len, device=device)[:, None]
            kpos = torch.arange(self.seq_len, device=device)[None, :]
            self.windowed[window] = (kpos <= qpos) & (kpos > qpos - window)
        return self.windowed[window]


def _decode_groups(md: AttentionMetadata) -> list[_DecodeGroup]:
    nd = md.num_decodes
    if nd == 0:
        return []
    lens = md.seq_lens_cpu[:nd]
    order = sorted(range(nd), key=lens.__getitem__)
    groups: list[list[int]] = [[]]
    for i in order:  # split where the padded size would more than double
        g = groups[-1]
        if len(g) >= _MIN_GROUP and lens[i] > 2 * lens[g[0]] + md.block_size:
            groups.append([])
        groups[-1].append(i)
    out = []
    for g in groups:
        rows: slice | torch.Tensor
        if len(groups) == 1:
            rows, idx = slice(0, nd), None
        else:
            idx = torch.tensor(g, dtype=torch.long, device=md.block_tables.device)
            rows = idx
        max_len = max(lens[i] for i in g)
        nblocks = -(-max_len // md.block_size)
        bt = md.block_tables[:nd] if idx is None else md.block_tables.index_select(0, idx)
        bt = bt[:, :nblocks].long()
        seq = md.seq_lens[:nd] if idx is None else md.seq_lens.index_select(0, idx)
        mask = None
        if any(lens[i] != nblocks * md.block_size for i in g):
            pos = torch.arange(nblocks * md.block_size, device=bt.device)
            mask = (pos[None, :] < seq[:, None]).view(len(g), 1, 1, -1)
        out.append(_DecodeGroup(rows, bt, mask, seq, nblocks * md.block_size))
    return out


def _prefill_chunks(md: AttentionMetadata) -> list[_PrefillChunk]:
    chunks = []
    start = md.num_decodes
    for i in range(md.num_decodes, md.num_reqs):
        ql, sl = md.query_lens_cpu[i], md.seq_lens_cpu[i]
        blocks = md.block_tables[i, : -(-sl // md.block_size)].long()
        mask = None
        if sl != ql:
            dev = md.block_tables.device
            qpos = torch.arange(sl - ql, sl, device=dev)
            mask = torch.arange(sl, device=dev)[None, :] <= qpos[:, None]
        chunks.append(_PrefillChunk(start, start + ql, blocks, sl != ql, sl, mask))
        start += ql
    return chunks


@dataclass
class TorchPrepared(PreparedAttention):
    """A step for the torch backend: its decodes in groups of similar length, its prefill chunks, and the
    scratch buffer every layer gathers cache blocks into."""

    decode: list[_DecodeGroup]
    prefill: list[_PrefillChunk]
    buffer: _GatherBuffer


class TorchMetadataBuilder(AttentionMetadataBuilder):
    """Plans steps for the torch backend; owns the scratch buffer its plans lend every layer."""

    def __init__(self, layout: AttentionLayout) -> None:
        super().__init__(layout)
        self.buffer = _GatherBuffer()

    def build(self, md: AttentionMetadata) -> TorchPrepared:
        return TorchPrepared(_decode_groups(md), _prefill_chunks(md), self.buffer)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    plan_type = TorchPrepared

    @classmethod
    def make_builder(cls, layout: AttentionLayout) -> AttentionMetadataBuilder:
        return TorchMetadataBuilder(layout)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata,
        p: TorchPrepared,
    ) -> torch.Tensor:
        """Write k/v into the cache, then attend every request of ``p`` with SDPA."""
        write_kv_cache(k, v, kv_cache, md.slot_mapping)
        out = torch.empty_like(q)
        for group in p.decode:
            self._decode(q, kv_cache, group, out, p.buffer)
        for chunk in p.prefill:
            self._prefill(q, k, v, kv_cache, chunk, out, p.buffer)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: KVCache, g: _DecodeGroup, out: torch.Tensor, buffer: _GatherBuffer
    ) -> None:
        n, nblocks = g.block_table.shape
        shape = (n, nblocks * kv_cache[0].shape[1], self.num_kv_heads, self.head_dim)
        k_blocks, v_blocks = buffer.gather(kv_cache, g.block_table.reshape(-1), q.dtype)
        keys = k_blocks.view(shape).transpose(1, 2)
        values = v_blocks.view(shape).transpose(1, 2)
        qg = q[g.rows].unsqueeze(2)  # [n, heads, 1, dim]
        o = self._sdpa(qg, keys, values, g.mask_for(self.sliding_window), False).squeeze(2)
        if isinstance(g.rows, slice):
            out[g.rows] = o
        else:
            out.index_copy_(0, g.rows, o)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        c: _PrefillChunk,
        out: torch.Tensor,
        buffer: _GatherBuffer,
    ) -> None:
        qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)
        if not c.from_cache and not isinstance(kv_cache, Fp8KVCache):  # an FP8 cache's values are read back, as
            keys, values = k[c.start : c.end], v[c.start : c.end]  # the Triton kernels read them
        else:
            k_blocks, v_blocks = buffer.gather(kv_cache, c.blocks, q.dtype)
            keys = k_blocks.flatten(0, 1)[: c.seq_len]
            values = v_blocks.flatten(0, 1)[: c.seq_len]
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        mask = c.mask_for(self.sliding_window, q.device)
        o = self._sdpa(qc, keys, values, mask, mask is None and c.end - c.start > 1)
        out[c.start : c.end] = o.squeeze(0).transpose(0, 1)

    @property
    def _gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """SDPA of q [b, heads, m, d] over k/v [b, kv_heads, n, d] (``mask``: [.., m, n] bool, True = attend);
        with soft-capping, the eager form HF Gemma 2 runs (the logits capped, then the float32 softmax)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=self._gqa)
        return softcapped_attention(q, k, v, mask, causal, self.scale, self.softcap)


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention whose logits are soft-capped, ``softcap * tanh(s / softcap)``, before the mask and the softmax."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        m, n = s.shape[-2:]
        mask = torch.ones(m, n, dtype=torch.bool, device=s.device).tril(n - m)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)
