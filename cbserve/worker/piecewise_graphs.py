"""Piecewise CUDA graphs: steps that mix prefill chunks with decodes (or hold only prefill chunks), replayed
in pieces with the attention run eagerly between them, as vLLM V1 does.

The decode graphs (cuda_graphs.py) capture a whole decode-only step, attention included, because a decode
batch has one shape per batch size. A step with prefill chunks has data-dependent attention shapes, so it ran
eagerly: a few hundred kernel launches from Python, bound by the host (about 18 ms for a Llama-3-8B-shaped
model on an H200 at any batch). Here the model's forward is cut at each layer's attention into
``num_layers + 1`` pieces: the embedding and layer 0 up to its attention's q, k, v; then for each layer its
output projection, MLP and norms followed by the next layer up to its q, k, v; then the last layer's rest. Each
piece is captured once per token-count bucket over static input buffers (token ids and positions; rows past
the step's tokens are padding: token 0 at position 0). A replay runs piece 0, then per layer the attention
eagerly on the step's real metadata (its plan built by the runner's builder as in an eager step) over the
real rows of the piece's q, k, v, writing the result into one static buffer the next piece reads, then the
next piece. Padded rows never reach the attention, so they never write the KV cache; their hidden rows are
dropped. Any attention backend works (the attention is not captured).

The runner uses them with ``cudagraph_mode: full_and_piecewise`` (decode-only steps still replay the full
decode graphs). ``capture`` is the one CUDA-only step: tests pass a stand-in for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .attention.backend import AttentionMetadata, KVCache
from .cuda_graphs import GraphedRunner, Replayable, capture_cuda_graph

logger = logging.getLogger(__name__)

MAX_PIECEWISE_TOKENS = 512  # larger steps are compute-bound: launches are a small share of their time

Outputs = tuple[torch.Tensor, ...]
# (piece over the static buffers, memory pool) -> (graph, the static outputs it fills on replay)
PieceCaptureFn = Callable[[Callable[[], Outputs], Any], tuple[Replayable, Outputs]]


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token-count buckets: 1, 2, 4, 8, every 16 up to 256, every 32 up to ``max_tokens`` (always included)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_tokens} | set(range(16, min(max_tokens, 256) + 1, 16))
    sizes |= set(range(288, max_tokens + 1, 32)) | {max_tokens}
    return sorted(sizes)


class _Bucket:
    """The captured pieces of one token count: each piece's graph and its static outputs."""

    def __init__(self) -> None:
        self.graphs: list[Replayable] = []
        self.outputs: list[Outputs] = []


class PiecewiseCUDAGraphs:
    """Captured pieces of ``model`` (a ``CausalLM``: ``embed``, ``layer_rope`` and the layers'
    ``before_attention`` / ``after_attention``) for steps of up to ``max_tokens`` tokens."""

    def __init__(
        self, model: Any, kv_caches: list[KVCache], *, max_tokens: int, device: torch.device,
        sizes: Sequence[int] | None = None, capture: PieceCaptureFn = capture_cuda_graph,
    ) -> None:
        self.sizes = sorted(sizes) if sizes is not None else piecewise_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.device = device
        self._model = model
        self._layers = list(model.model.layers)
        self._kv_caches = kv_caches
        self._capture = capture
        self._buckets: dict[int, _Bucket] = {}
        attn = self._layers[0].self_attn
        dtype = model.model.embed_tokens.weight.dtype
        with torch.inference_mode():
            self._input_ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
            self._positions = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
            # every layer's attention result, read by the piece after it (one buffer: pieces run in order)
            self._attn_out = torch.zeros(self.max_tokens, attn.num_heads, attn.head_dim, dtype=dtype, device=device)

    # ---- the pieces ---------------------------------------------------------------------------------
    def _first(self, b: int) -> Callable[[], Outputs]:
        ids, pos = self._input_ids[:b], self._positions[:b]

        def piece() -> Outputs:
            x = self._model.embed(ids)
            return self._layers[0].before_attention(x, None, self._model.layer_rope(0, pos, x.dtype))

        return piece

    def _middle(self, b: int, i: int, residual: torch.Tensor) -> Callable[[], Outputs]:
        """Layer ``i - 1`` after its attention, then layer ``i`` up to its attention."""
        pos, o = self._positions[:b], self._attn_out[:b]

        def piece() -> Outputs:
            h, res = self._layers[i - 1].after_attention(o, residual)
            return self._layers[i].before_attention(h, res, self._model.layer_rope(i, pos, h.dtype))

        return piece

    def _last(self, b: int, residual: torch.Tensor) -> Callable[[], Outputs]:
        o = self._attn_out[:b]

        def piece() -> Outputs:
            h, res = self._layers[-1].after_attention(o, residual)
            return (h + res,)

        return piece

    # ---- capture and replay -------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's pieces, largest bucket first, all in one memory pool (replayed in the
        order captured, as the pool requires). All rows are padding while capturing; no attention runs."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
            pool = torch.cuda.graph_pool_handle() if cuda else None
            for b in sorted(self.sizes, reverse=True):
                bucket = _Bucket()
                piece = self._first(b)
                for i in range(len(self._layers) + 1):
                    graph, out = self._capture(piece, pool)
                    bucket.graphs.append(graph)
                    bucket.outputs.append(out)
                    if i + 1 < len(self._layers):
                        piece = self._middle(b, i + 1, out[3])
                    elif i + 1 == len(self._layers):
                        piece = self._last(b, out[3])
                self._buckets[b] = bucket
            if cuda:
                torch.cuda.synchronize(self.device)
        logger.info("captured piecewise CUDA graphs for %d token counts (%d..%d), %d pieces each, in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_tokens, len(self._layers) + 1, time.perf_counter() - t0)

    def can_run(self, num_tokens: int) -> bool:
        return bool(self._buckets) and 0 < num_tokens <= self.max_tokens

    def bucket(self, n: int) -> int:
        """The smallest captured token count that holds ``n`` tokens."""
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of the step (``md.prepared``: the step's attention plan). The result
        is a view of graph memory, valid until the next ``run``."""
        n = input_ids.shape[0]
        if not self.can_run(n):
            raise ValueError(f"a step of {n} tokens cannot replay piecewise graphs (at most {self.max_tokens})")
        b = self.bucket(n)
        self._input_ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self._input_ids[n:b].zero_()
        self._positions[n:b].zero_()
        bucket = self._buckets[b]
        for i, layer in enumerate(self._layers):
            bucket.graphs[i].replay()
            q, k, v, _ = bucket.outputs[i]
            o = layer.self_attn.attn.forward(q[:n], k[:n], v[:n], self._kv_caches[i], md)
            self._attn_out[:n].view(n, -1).copy_(o.reshape(n, -1))
        bucket.graphs[-1].replay()
        return bucket.outputs[-1][0][:n]


def maybe_capture_piecewise_graphs(
    runner: GraphedRunner, capture: PieceCaptureFn | None = None
) -> PiecewiseCUDAGraphs | None:
    """Piecewise graphs for ``runner`` (KV cache allocated) with ``cudagraph_mode: full_and_piecewise``, or
    None (another mode, ``enforce_eager``, or a model whose forward cannot be captured). ``capture=None``: real
    CUDA graphs, on a CUDA device only; a stand-in ``capture`` (tests) runs on any device. The attention is not
    captured, so the backend need not support graphs."""
    if runner.config.cudagraph_mode != "full_and_piecewise" or runner.config.enforce_eager:
        return None
    if capture is None:
        if runner.device.type != "cuda":
            return None
        capture = capture_cuda_graph
    if not runner.kv_caches:
        raise RuntimeError("init_kv_cache() must run before capturing CUDA graphs")
    blocker = getattr(runner.model, "cuda_graphs_blocker", None)
    if blocker:
        logger.info("steps with prefill chunks run eagerly (no piecewise CUDA graphs: %s)", blocker)
        return None
    graphs = PiecewiseCUDAGraphs(
        runner.model, runner.kv_caches, max_tokens=min(runner.max_num_batched_tokens, MAX_PIECEWISE_TOKENS),
        device=runner.device, capture=capture,
    )
    graphs.capture()
    return graphs
