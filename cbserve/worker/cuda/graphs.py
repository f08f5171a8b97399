"""CUDA graphs for decode-only iterations, captured at fixed batch-size buckets.

A decode step of a small batch is dominated by kernel-launch overhead (hundreds of launches for a 32-layer
model), so the model forward (embedding .. final residual add, not the LM head or sampling) is captured
once per bucket size and replayed. Inputs live in static buffers sized for the largest bucket; a batch of
``n`` decodes runs in the smallest bucket ``b >= n`` with rows ``n..b-1`` padded: token 0 at position 0,
slot ``-1`` (the cache-write kernel skips it, so padding never touches the KV cache) and ``seq_len 0`` (the
decode kernel returns zeros for it). Their hidden rows are dropped; the LM head runs eagerly on the rows
to sample.

Only backends whose decode path is shape-stable and free of host synchronisation declare
``supports_cuda_graphs = True`` (Triton, flash-attn); the torch reference backend does not. A graph's
static metadata carries host fields at their worst case (every context ``max_model_len`` long), so the plan
the runner's attention builder makes for it at capture (``build_attention``, set as the metadata's
``prepared``) picks launch constants (the Triton decode kernel's split count) that hold for any batch the
graph replays; a replay uses that plan, none is built for it. Graphs are off on CPU and with
``ModelConfig.enforce_eager``.

The model runner captures them in ``init_kv_cache`` (``maybe_capture_decode_graphs``) and replays one in
``_forward`` when ``can_run`` holds. ``capture`` is the one CUDA-only step: tests pass a stand-in for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from cbserve.worker.attention.backend import AttentionMetadata, AttentionMetadataBuilder, KVCache, PreparedAttention
from cbserve.worker.config import ModelConfig

logger = logging.getLogger(__name__)

ModelFn = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata], torch.Tensor]
Out = TypeVar("Out")
PAD_SLOT = -1  # slot mapping of padded rows: the cache-write kernels skip negative slots


class Replayable(Protocol):
    def replay(self) -> None: ...


# (forward over the static buffers, memory pool) -> (graph, the static output tensor it fills on replay)
CaptureFn = Callable[[Callable[[], torch.Tensor], Any], tuple[Replayable, torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, then every 16 up to ``max_batch`` (always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


def graphs_supported(device: torch.device, backend_cls: type, enforce_eager: bool) -> bool:
    supported = bool(getattr(backend_cls, "supports_cuda_graphs", False))
    return device.type == "cuda" and not enforce_eager and supported


def capture_cuda_graph(forward: Callable[[], Out], pool: Any) -> tuple[Replayable, Out]:
    """Record ``forward`` into a CUDA graph (after two warm-up runs: Triton JIT, cuBLAS workspaces); returns the
    graph and ``forward``'s result (a tensor or a tuple of them), the static outputs a replay fills."""
    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


class DecodeCUDAGraphs:
    """Captured decode forwards of ``model`` (signature ``model(input_ids, positions, kv_caches, md)``)."""

    def __init__(
        self, model: ModelFn, kv_caches: list[KVCache], *, max_batch: int, max_model_len: int,
        block_size: int, build_attention: Callable[[AttentionMetadata], PreparedAttention],
        device: torch.device, sizes: Sequence[int] | None = None, capture: CaptureFn = capture_cuda_graph,
    ) -> None:
        """``build_attention``: the runner's attention builder's ``build``; each graph's static metadata gets
        its plan before capture."""
        self.sizes = sorted(sizes) if sizes is not None else capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self._model = model
        self._kv_caches = kv_caches
        self._build_attention = build_attention
        self._capture = capture
        self._replays: dict[int, tuple[Replayable, torch.Tensor]] = {}  # size -> (graph, static output)
        b, i32 = self.max_batch, dict(dtype=torch.int32, device=device)
        with torch.inference_mode():
            self._input_ids = torch.zeros(b, dtype=torch.long, device=device)
            self._positions = torch.zeros(b, dtype=torch.long, device=device)
            self._slots = torch.full((b,), PAD_SLOT, dtype=torch.long, device=device)
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
        )

    def _forward(self, b: int, md: AttentionMetadata) -> torch.Tensor:
        return self._model(self._input_ids[:b], self._positions[:b], self._kv_caches, md)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool. All rows are padding
        while capturing: nothing is written to the KV cache."""
        t0 = time.perf_counter()
        self._pad(0, self.max_batch)
        cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
            pool = torch.cuda.graph_pool_handle() if cuda else None
            for b in sorted(self.sizes, reverse=True):
                md = self._metadata(b)
                md.prepared = self._build_attention(md)
                self._replays[b] = self._capture(lambda b=b, md=md: self._forward(b, md), pool)
            if cuda:
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

    def bucket(self, n: int) -> int:
        """The smallest captured batch size that holds ``n`` decodes."""
        return next(s for s in self.sizes if s >= n)

    def _pad(self, start: int, end: int) -> None:
        self._input_ids[start:end].zero_()
        self._positions[start:end].zero_()
        self._slots[start:end].fill_(PAD_SLOT)  # padding must never write the KV cache
        self._seq_lens[start:end].zero_()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch (``can_run`` must hold). The result is a view
        of graph memory, valid until the next ``run``."""
        n = input_ids.shape[0]
        if not self.can_run(n, md):
            raise ValueError(f"batch of {n} tokens / {md.num_decodes} decodes cannot replay a decode graph")
        b = self.bucket(n)
        self._input_ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self._slots[:n].copy_(md.slot_mapping, non_blocking=True)
        self._seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self._tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)
        self._pad(n, b)
        graph, out = self._replays[b]
        graph.replay()
        return out[:n]


class GraphedRunner(Protocol):
    """What capturing needs of the model runner (model_runner.ModelRunner)."""

    config: ModelConfig
    device: torch.device
    backend_cls: type
    attention_builder: AttentionMetadataBuilder
    model: Any
    kv_caches: list[KVCache]
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int


def maybe_capture_decode_graphs(runner: GraphedRunner, capture: CaptureFn | None = None) -> DecodeCUDAGraphs | None:
    """Capture decode graphs for ``runner`` (KV cache allocated), or None with ``enforce_eager`` or a backend
    without graph support. ``capture=None``: real CUDA graphs, on a CUDA device only; a stand-in ``capture``
    (tests) runs on any device."""
    if capture is None:
        if not graphs_supported(runner.device, runner.backend_cls, runner.config.enforce_eager):
            return None
        capture = capture_cuda_graph
    elif runner.config.enforce_eager or not getattr(runner.backend_cls, "supports_cuda_graphs", False):
        return None
    if not runner.kv_caches:
        raise RuntimeError("init_kv_cache() must run before capturing CUDA graphs")
    blocker = getattr(runner.model, "cuda_graphs_blocker", None)
    if blocker:  # the model's forward cannot be captured (a host sync or data-dependent shapes)
        logger.info("decode steps run eagerly (no CUDA graphs: %s)", blocker)
        return None
    graphs = DecodeCUDAGraphs(
        runner.model, runner.kv_caches,
        max_batch=min(runner.max_num_seqs, runner.max_num_batched_tokens),
        max_model_len=runner.max_model_len, block_size=runner.block_size,
        build_attention=runner.attention_builder.build, device=runner.device, capture=capture,
    )
    graphs.capture()
    return graphs
