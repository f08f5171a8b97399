"""The step timings of ``gpu_check.py``'s part 2, on a built runner: a decode step eagerly and from its CUDA graph,
a step mixing decodes with a prefill chunk eagerly and from piecewise CUDA graphs (their capture, and a dry run's
stand-ins for it), each the median of interleaved repeats after a warm-up of both ways
(``gpu_rooflines.time_interleaved``); and the release of a freed executor's GPU memory."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from gpu_rooflines import _batch, _mixed_batch, _step_fn, _weight_bytes, time_interleaved


def decode_row(runner: Any, b: int, ctx: int, bw: float, repeats: int) -> dict[str, Any]:
    """One decode step of ``b`` requests with ``ctx`` tokens of context each, eagerly and replayed from the
    runner's CUDA graph when there is one (interleaved repeats, medians), against (weight bytes + KV bytes read)
    / the measured copy bandwidth."""
    ctx = min(ctx, runner.max_model_len, runner.num_blocks // b * runner.block_size)
    batch = _batch(runner, b, ctx, 1)
    ways = {"eager": _step_fn(runner, batch)}
    graphs = runner.graphs
    if graphs is not None and b <= graphs.max_batch:
        ways["graph"] = _step_fn(runner, batch, graphs)
    t = time_interleaved(ways, runner.device, repeats=repeats, iters=10, warmup=3, warmup_s=0.2)
    eager, graph = t["eager"].median_s, t["graph"].median_s if "graph" in t else None
    roofline = (_weight_bytes(runner.model) + b * ctx * (runner.block_bytes() // runner.block_size)) / bw
    served = graph if graph is not None else eager
    return {
        "batch": b,
        "context": ctx,
        "eager_ms": eager * 1e3,
        "graph_ms": graph and graph * 1e3,
        "roofline_ms": roofline * 1e3,
        "roofline_fraction": roofline / served,
        "graphs_speedup": graph and eager / graph,
        "tok_s": b / served,
        "timing": {k: v.record() for k, v in t.items()},
    }


class _EagerPiece:
    """A dry run's stand-in for a captured piece: a piece writes only static buffers, so a replay reruns it."""

    def __init__(self, forward: Any) -> None:
        self.replay = forward
        forward()


def _eager_pieces(forward: Any, pool: Any) -> tuple[_EagerPiece, None]:
    return _EagerPiece(forward), None


def capture_piecewise(runner: Any) -> tuple[Any, float]:
    """Piecewise CUDA graphs (``cudagraph_mode: full_and_piecewise``) captured on the runner built with the
    decode graphs only, and the seconds the capture took (a dry run: stand-ins that rerun each piece)."""
    from cbserve.worker.cuda.piecewise_graphs import MAX_PIECEWISE_TOKENS, PiecewiseCUDAGraphs

    kw = {} if runner.device.type == "cuda" else {"capture": _eager_pieces}
    pieces = PiecewiseCUDAGraphs(
        runner.model,
        runner.kv_caches,
        device=runner.device,
        max_tokens=min(runner.max_num_batched_tokens, MAX_PIECEWISE_TOKENS),
        **kw,
    )
    t0 = time.perf_counter()
    pieces.capture()
    return pieces, time.perf_counter() - t0


def mixed_row(runner: Any, pieces: Any, decodes: int, ctx: int, chunk: int, repeats: int) -> dict[str, Any]:
    """One step of ``decodes`` decodes and a ``chunk``-token prefill chunk, eagerly and from the pieces."""
    ctx = min(ctx, runner.max_model_len)
    batch = _mixed_batch(runner, decodes, ctx, chunk)
    t = time_interleaved(
        {"eager": _step_fn(runner, batch), "piecewise": _step_fn(runner, batch, pieces)},
        runner.device,
        repeats=repeats,
        iters=10,
        warmup=3,
        warmup_s=0.2,
    )
    eager, piecewise = t["eager"].median_s, t["piecewise"].median_s
    return {
        "decodes": decodes,
        "context": ctx,
        "chunk": chunk,
        "tokens": decodes + chunk,
        "bucket": pieces.bucket(decodes + chunk),
        "eager_ms": eager * 1e3,
        "piecewise_ms": piecewise * 1e3,
        "piecewise_speedup": eager / piecewise,
        "timing": {k: v.record() for k, v in t.items()},
    }


def release_memory(device: torch.device) -> None:
    """Give the memory of what is no longer referenced back to the device (the caller shut its executor down and
    dropped every reference to it first)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
