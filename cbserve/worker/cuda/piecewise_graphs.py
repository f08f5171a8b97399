"""Piecewise CUDA graphs: steps that mix prefill chunks with decodes (or hold only prefill chunks), replayed
in pieces with the attention run eagerly between them, as vLLM V1 does.

The decode graphs (worker/cuda/graphs.py) capture a whole decode-only step, attention included, because a
decode batch has one shape per batch size. A step with prefill chunks has data-dependent attention shapes, so it
runs eagerly: a few hundred kernel launches from Python, bound by the host (eager decode steps of a
Llama-3-8B-shaped model took about 18 ms on an H200 at any batch; ``make gpu-check`` times the mixed steps
both ways). Here the model's forward is cut at each layer's attention into
``num_layers + 1`` pieces: the embedding and layer 0 up to its attention's q, k, v; then for each layer its
output projection, MLP and norms followed by the next layer up to its q, k, v; then the last layer's rest. Each
piece is captured once per token-count bucket (rows past the step's tokens are padding: token 0 at position 0).

Every value that crosses from one piece to the next lives in a static buffer allocated before capture, outside
the graphs' memory pool: the token ids and positions, the residual stream, the q/k/v rows each piece copies
out for the attention, the attention's result and the final hidden states. A piece therefore keeps nothing
alive in the pool after its capture, and all pieces of all buckets share one pool of temporaries (a
Llama-3-8B-sized model would otherwise hold ~2 GiB of q/k/v per bucket set). A replay runs piece 0, then per
layer the attention eagerly on the step's real metadata (its plan built by the runner's builder, as in an
eager step) over the real rows of the q/k/v buffer, writing the attention buffer the next piece reads, then
the next piece. Padded rows never reach the attention, so they never write the KV cache; their hidden rows are
dropped. Any attention backend works (the attention is not captured). A ``run`` consumes what its pieces
wrote, and runs never interleave, so buckets may replay in any order.

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

from cbserve.worker.attention.backend import AttentionMetadata, KVCache
from cbserve.worker.cuda.graphs import GraphedRunner, Replayable, capture_cuda_graph

logger = logging.getLogger(__name__)

MAX_PIECEWISE_TOKENS = 512  # larger steps are compute-bound: launches are a small share of their time

# (piece over the static buffers, memory pool) -> (graph, None): a piece writes only static buffers
PieceCaptureFn = Callable[[Callable[[], None], Any], tuple[Replayable, None]]


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token-count buckets: 1, 2, 4, 8, every 16 up to 256, every 32 up to ``max_tokens`` (always included)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_tokens} | set(range(16, min(max_tokens, 256) + 1, 16))
    sizes |= set(range(288, max_tokens + 1, 32)) | {max_tokens}
    return sorted(sizes)


class PiecewiseCUDAGraphs:
    """Captured pieces of ``model`` (a ``CausalLM``: ``embed``, ``layer_rope`` and the layers'
    ``before_attention`` / ``after_attention``) for steps of up to ``max_tokens`` tokens."""

    def __init__(
        self, model: Any, kv_caches: list[KVCache], *, max_tokens: int, device: torch.device,
        sizes: Sequence[int] | None = None, capture: PieceCaptureFn = capture_cuda_graph,
    ) -> None:
        self.sizes = sorted(sizes) if sizes is not None else piecewise_sizes(max_tokens)
        self.max_tokens = t = self.sizes[-1]
        self.device = device
        self._model = model
        self._layers = list(model.model.layers)
        self._kv_caches = kv_caches
        self._capture = capture
        self._graphs: dict[int, list[Replayable]] = {}  # bucket -> its pieces, in order
        attn = self._layers[0].self_attn
        self._heads, self._kv_heads = attn.num_heads, attn.num_kv_heads
        weight = model.model.embed_tokens.weight
        hidden, f = weight.shape[1], dict(dtype=weight.dtype, device=device)
        with torch.inference_mode():
            self._input_ids = torch.zeros(t, dtype=torch.long, device=device)
            self._positions = torch.zeros(t, dtype=torch.long, device=device)
            self._residual = torch.zeros(t, hidden, **f)
            self._qkv = torch.zeros(t, self._heads + 2 * self._kv_heads, attn.head_dim, **f)
            self._attn_out = torch.zeros(t, self._heads, attn.head_dim, **f)  # each layer's, read by the next piece
            self._hidden = torch.zeros(t, hidden, **f)

    # ---- the pieces ---------------------------------------------------------------------------------
    def _stage(self, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
        """A layer's q, k, v into the attention's buffer, the residual stream into its own (where the fused
        norm did not already update it there in place)."""
        h, kv = self._heads, self._kv_heads
        self._qkv[:b, :h].copy_(q)
        self._qkv[:b, h : h + kv].copy_(k)
        self._qkv[:b, h + kv :].copy_(v)
        if residual.data_ptr() != self._residual.data_ptr():
            self._residual[:b].copy_(residual)

    def _piece(self, b: int, i: int) -> Callable[[], None]:
        """Piece ``i`` of bucket ``b``: layer ``i - 1`` after its attention (none for i = 0: the embedding),
        then layer ``i`` up to its attention (none for the last piece: the final hidden states)."""
        ids, pos, res, o = self._input_ids[:b], self._positions[:b], self._residual[:b], self._attn_out[:b]
        last = i == len(self._layers)

        def piece() -> None:
            if i == 0:
                h, r = self._model.embed(ids), None
            else:
                h, r = self._layers[i - 1].after_attention(o, res)
            if last:
                torch.add(h, r, out=self._hidden[:b])
            else:
                self._stage(b, *self._layers[i].before_attention(h, r, self._model.layer_rope(i, pos, h.dtype)))

        return piece

    # ---- capture and replay -------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's pieces, largest bucket first, in one memory pool of temporaries. All rows are
        padding while capturing; no attention runs."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
            pool = torch.cuda.graph_pool_handle() if cuda else None
            for b in sorted(self.sizes, reverse=True):
                self._graphs[b] = [self._capture(self._piece(b, i), pool)[0] for i in range(len(self._layers) + 1)]
            if cuda:
                torch.cuda.synchronize(self.device)
        logger.info("captured piecewise CUDA graphs for %d token counts (%d..%d), %d pieces each, in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_tokens, len(self._layers) + 1, time.perf_counter() - t0)

    def can_run(self, num_tokens: int) -> bool:
        return bool(self._graphs) and 0 < num_tokens <= self.max_tokens

    def bucket(self, n: int) -> int:
        """The smallest captured token count that holds ``n`` tokens."""
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of the step (``md.prepared``: the step's attention plan). The result
        is a view of a static buffer, valid until the next ``run``."""
        n = input_ids.shape[0]
        if not self.can_run(n):
            raise ValueError(f"a step of {n} tokens cannot replay piecewise graphs (at most {self.max_tokens})")
        b = self.bucket(n)
        self._input_ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self._input_ids[n:b].zero_()
        self._positions[n:b].zero_()
        graphs, h, kv = self._graphs[b], self._heads, self._kv_heads
        q, k, v = self._qkv[:n, :h], self._qkv[:n, h : h + kv], self._qkv[:n, h + kv :]
        for i, layer in enumerate(self._layers):
            graphs[i].replay()
            o = layer.self_attn.attn.forward(q, k, v, self._kv_caches[i], md)
            self._attn_out[:n].view(n, -1).copy_(o.reshape(n, -1))
        graphs[-1].replay()
        return self._hidden[:n]


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
