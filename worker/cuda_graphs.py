"""CUDA graphs for decode-only iterations, captured at fixed batch-size buckets.

A decode step of a small batch is dominated by kernel-launch overhead (hundreds of launches for a 32-layer
model), so the model forward (embedding .. final residual add, not the LM head or sampling) is captured
once per bucket size and replayed. Inputs live in static buffers sized for the largest bucket; a batch of
``n`` decodes runs in the smallest bucket ``b >= n`` with rows ``n..b-1`` padded: slot ``-1`` (the
cache-write kernel skips it, so padding never touches the KV cache) and ``seq_len 0`` (the decode kernel
returns zeros for it). Their hidden rows are discarded.

Only backends whose decode path is shape-stable and free of host synchronisation declare
``supports_cuda_graphs = True`` (Triton, flash-attn); the torch reference backend does not. The Triton
decode kernel's split count is fixed per graph through ``metadata.extras["decode_num_splits"]`` (sized for
``max_model_len``; each request's split length is computed in-kernel from its own ``seq_len``).
Graphs are off on CPU and with ``ModelConfig.enforce_eager``.

Use from the model runner (after ``init_kv_cache``)::

    self.graphs = maybe_capture_decode_graphs(self)
    ...
    if self.graphs is not None and self.graphs.can_run(batch.input_ids.shape[0], batch.metadata):
        hidden = self.graphs.run(batch.input_ids, batch.positions, batch.metadata)
    else:
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .attention.backend import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from .model_runner import ModelRunner

logger = logging.getLogger(__name__)

NUM_SPLITS_KEY = "decode_num_splits"  # same key as attention.triton_backend.NUM_SPLITS_KEY
ModelFn = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata], torch.Tensor]


def capture_sizes(max_batch: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, then every 16 up to ``max_batch`` (always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


def graphs_supported(device: torch.device, backend_cls: type, enforce_eager: bool) -> bool:
    supported = bool(getattr(backend_cls, "supports_cuda_graphs", False))
    return device.type == "cuda" and not enforce_eager and supported


def _num_splits(batch: int, num_kv_heads: int, max_model_len: int, device: torch.device) -> int:
    from .attention.triton_kernels import default_num_splits

    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return default_num_splits(batch, num_kv_heads, max_model_len, sms)


class DecodeCUDAGraphs:
    """Captured decode forwards of ``model`` (signature ``model(input_ids, positions, kv_caches, md)``)."""

    def __init__(
        self, model: ModelFn, kv_caches: list[KVCache], *, max_batch: int, max_model_len: int,
        block_size: int, num_kv_heads: int, prepare: Callable[[AttentionMetadata], None],
        device: torch.device, sizes: Sequence[int] | None = None,
    ) -> None:
        self.sizes = sorted(sizes) if sizes is not None else capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self._model = model
        self._kv_caches = kv_caches
        self._prepare = prepare
        self._replays: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (graph or replay fn, output)
        b, i32 = self.max_batch, dict(dtype=torch.int32, device=device)
        with torch.inference_mode():
            self._input_ids = torch.zeros(b, dtype=torch.long, device=device)
            self._positions = torch.zeros(b, dtype=torch.long, device=device)
            self._slots = torch.full((b,), -1, dtype=torch.long, device=device)
            self._seq_lens = torch.zeros(b, **i32)
            self._tables = torch.zeros(b, self.max_blocks, **i32)
            self._query_start = torch.arange(b + 1, **i32)

    def _metadata(self, b: int) -> AttentionMetadata:
        """Static metadata of bucket ``b``: views of the buffers, host fields at their worst case."""
        return AttentionMetadata(
            slot_mapping=self._slots[:b], block_tables=self._tables[:b], seq_lens=self._seq_lens[:b],
            query_start_loc=self._query_start[: b + 1], num_decodes=b, max_query_len=1,
            max_seq_len=self.max_model_len, block_size=self.block_size, query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b,
            extras={NUM_SPLITS_KEY: _num_splits(b, self.num_kv_heads, self.max_model_len, self.device)},
        )

    def _forward(self, b: int, md: AttentionMetadata) -> torch.Tensor:
        return self._model(self._input_ids[:b], self._positions[:b], self._kv_caches, md)

    def _capture_one(self, b: int, md: AttentionMetadata, pool: Any) -> tuple[Any, torch.Tensor]:
        for _ in range(2):  # warm-up outside capture: Triton JIT compile, cuBLAS workspaces, autotuning
            self._forward(b, md)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(b, md)
        return graph, out

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        t0 = time.perf_counter()
        self._slots.fill_(-1)
        self._seq_lens.zero_()
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for b in sorted(self.sizes, reverse=True):
            md = self._metadata(b)
            self._prepare(md)
            self._replays[b] = self._capture_one(b, md, pool)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.max_batch, time.perf_counter() - t0)

    def can_run(self, num_tokens: int, md: AttentionMetadata) -> bool:
        """True for a decode-only batch that fits the largest captured bucket."""
        return (
            bool(self._replays) and 0 < num_tokens <= self.max_batch
            and md.num_decodes == num_tokens == md.seq_lens.shape[0]
            and md.block_tables.shape[1] <= self.max_blocks and md.max_seq_len <= self.max_model_len
        )

    def _bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch (``can_run`` must hold). The result is a view
        of graph memory, valid until the next ``run``."""
        n = input_ids.shape[0]
        if not self.can_run(n, md):
            raise ValueError(f"batch of {n} tokens / {md.num_decodes} decodes cannot replay a decode graph")
        b = self._bucket(n)
        self._input_ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self._slots[:n].copy_(md.slot_mapping, non_blocking=True)
        self._slots[n:b].fill_(-1)  # padding must never write the KV cache
        self._seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self._seq_lens[n:b].zero_()
        self._tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)
        replay, out = self._replays[b]
        replay.replay()
        return out[:n]


def maybe_capture_decode_graphs(runner: ModelRunner) -> DecodeCUDAGraphs | None:
    """Capture decode graphs for ``runner`` (KV cache allocated), or None on CPU / enforce_eager / a backend
    without graph support."""
    if not graphs_supported(runner.device, runner.backend_cls, runner.config.enforce_eager):
        return None
    if not runner.kv_caches:
        raise RuntimeError("init_kv_cache() must run before capturing CUDA graphs")
    graphs = DecodeCUDAGraphs(
        runner.model, runner.kv_caches,
        max_batch=min(runner.max_num_seqs, runner.max_num_batched_tokens),
        max_model_len=runner.max_model_len, block_size=runner.block_size, num_kv_heads=runner.num_kv_heads,
        prepare=runner.model.model.layers[0].self_attn.attn.prepare, device=runner.device,
    )
    graphs.capture()
    return graphs
