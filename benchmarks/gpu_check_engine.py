"""cbserve's offline engine as ``gpu_check.py`` drives it: the ``EngineCore`` of ``CBServeConfig.engine_config``
(async scheduling on, as ``LLM`` runs it) over a ``LocalExecutor``, turned by ``step_with_batch_queue`` as
``LLM.generate`` does, fed requests of fixed lengths (greedy, EOS ignored) with at most ``concurrency`` in the
engine at once, and stopped at a deadline. Every request's arrival, first token and finish are timed; a
``StepTimeline`` records each step's kind and tokens and, with CUDA events, where its time went."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# Seconds between two progress reports of a run (each saved to check.json: a part stopped keeps them).
PROGRESS_EVERY_S = 10.0


class _HostEvent:
    """A stand-in for ``torch.cuda.Event(enable_timing=True)`` on the CPU: the host clock when recorded."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


def _event(device: torch.device) -> Any:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    event = _HostEvent()
    event.record()
    return event


@dataclass
class _Step:
    kind: str
    tokens: int
    decodes: int
    prefill_tokens: int
    chunks: int
    events: list[Any]  # entry, before the forward, after it, return (the forward's two: None if it never ran)
    path: str = "none"  # how the forward ran: graph, piecewise, eager


class StepTimeline:
    """An executor that times each step it runs for the executor it wraps: the step's kind (``prefill``,
    ``decode`` or ``mixed``), its tokens, how the runner ran its forward (a decode CUDA graph, piecewise graphs or
    eagerly) and, on the device's clock (CUDA events; the host clock on the CPU), the host gap since the previous
    step returned, the host's preparation before the forward, the forward and the rest (LM head, sampling and
    the sync that brings the tokens back)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.runner = inner, inner.runner
        self.device: torch.device = self.runner.device
        self.num_blocks = inner.num_blocks
        self.steps: list[_Step] = []
        self._current: _Step | None = None

    def execute_model(self, so: Any) -> Future[Any]:
        new = {r.req_id for r in so.scheduled_new_reqs}
        decodes = sum(1 for r, n in so.num_scheduled_tokens.items() if n == 1 and r not in new)
        chunks = len(so.num_scheduled_tokens) - decodes
        prefill = so.total_num_scheduled_tokens - decodes
        kind = "decode" if not chunks else "prefill" if not decodes else "mixed"
        step = _Step(kind, so.total_num_scheduled_tokens, decodes, prefill, chunks, [_event(self.device), None, None])
        self._current = step
        try:
            return self.inner.execute_model(so)
        finally:
            step.events.append(_event(self.device))
            self.steps.append(step)
            self._current = None

    def shutdown(self) -> None:
        self.inner.shutdown()

    @contextmanager
    def attached(self) -> Iterator[StepTimeline]:
        """Time the runner's forward (``ModelRunner._hidden``) inside each step while the block runs."""
        runner, original = self.runner, self.runner._hidden  # AttributeError: the runner changed, say so

        def hidden(batch: Any) -> torch.Tensor:
            step = self._current
            if step is None:
                return original(batch)
            step.path = _forward_path(runner, batch)
            step.events[1] = _event(self.device)
            out = original(batch)
            step.events[2] = _event(self.device)
            return out

        runner._hidden = hidden
        try:
            yield self
        finally:
            del runner._hidden  # the class's method again

    def rows(self) -> list[dict[str, Any]]:
        """One row per step, milliseconds on the device's clock (synchronises the device first)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out, last_end = [], None
        for i, s in enumerate(self.steps):
            entry, fwd0, fwd1, end = s.events
            row = {
                "step": i,
                "kind": s.kind,
                "tokens": s.tokens,
                "decodes": s.decodes,
                "prefill_tokens": s.prefill_tokens,
                "chunks": s.chunks,
                "path": s.path,
                "gap_ms": None if last_end is None else _ms(last_end, entry),
                "step_ms": _ms(entry, end),
            }
            if fwd0 is not None and fwd1 is not None:
                row.update(prep_ms=_ms(entry, fwd0), forward_ms=_ms(fwd0, fwd1), tail_ms=_ms(fwd1, end))
            out.append(row)
            last_end = end
        return out


def _ms(start: Any, end: Any) -> float:
    """Milliseconds from one event to another, to the microsecond."""
    return round(start.elapsed_time(end), 3)


def _forward_path(runner: Any, batch: Any) -> str:
    """How ``ModelRunner._hidden`` runs this batch (the same tests, in the same order)."""
    n = batch.input_ids.shape[0]
    if runner.graphs is not None and runner.graphs.can_run(n, batch.metadata):
        return "graph"
    if runner.piecewise is not None and runner.piecewise.can_run(n):
        return "piecewise"
    return "eager"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step kind: steps, tokens and milliseconds (step, forward); the host gaps between steps; the paths."""
    kinds: dict[str, dict[str, float]] = {}
    for r in rows:
        k = kinds.setdefault(r["kind"], {"steps": 0, "tokens": 0, "step_ms": 0.0, "forward_ms": 0.0, "prep_ms": 0.0})
        k["steps"] += 1
        k["tokens"] += r["tokens"]
        k["step_ms"] += r["step_ms"]
        k["forward_ms"] += r.get("forward_ms") or 0.0
        k["prep_ms"] += r.get("prep_ms") or 0.0
    paths: dict[str, int] = {}
    for r in rows:
        paths[r["path"]] = paths.get(r["path"], 0) + 1
    gaps = [r["gap_ms"] for r in rows if r["gap_ms"] is not None]
    return {
        "steps": len(rows),
        "by_kind": {k: {n: round(v, 3) for n, v in d.items()} for k, d in kinds.items()},
        "host_gap_ms": round(sum(gaps), 3),
        "host_gap_ms_per_step": round(sum(gaps) / max(1, len(gaps)), 4),
        "paths": paths,
    }


@dataclass
class RunSpec:
    """One engine run: requests of ``prompts`` with ``outs`` output tokens each, at most ``concurrency`` in the
    engine at once (None: all at once), stopped at ``deadline`` (perf_counter seconds). ``window_s``: also the
    output tokens of the run's first ``window_s`` seconds (``window_figures``), and with ``stop_at_window`` the run
    ends there."""

    prompts: list[list[int]]
    outs: list[int]
    concurrency: int | None
    deadline: float
    progress: Callable[[dict[str, Any]], None] | None = None
    times: dict[str, list[float]] = field(default_factory=dict)  # req_id -> [arrival, first token, finish]
    window_s: float | None = None
    stop_at_window: bool = False


def new_engine(serve_config: Any, executor: Any) -> Any:
    """A fresh ``EngineCore`` (empty scheduler and KV cache manager) over ``executor``, configured as the offline
    ``LLM`` configures it from ``serve_config`` (a ``CBServeConfig``)."""
    from cbserve.scheduler.engine_core import EngineCore

    return EngineCore(serve_config.engine_config(executor.num_blocks), executor)


def drive(engine: Any, spec: RunSpec) -> dict[str, Any]:
    """Run ``spec`` on ``engine`` (``EngineCore``) as ``LLM.generate`` turns it; the figures of ``run_figures``
    (``partial`` when the deadline or the window cut it: the requests left are aborted and drained), with
    ``window`` (``window_figures``) when ``spec.window_s`` is set."""
    from cbserve.scheduler.requests.request import EngineRequest
    from cbserve.scheduler.requests.sampling_params import SamplingParams

    n, limit = len(spec.prompts), spec.concurrency or len(spec.prompts)
    preempted0, tokens, finished, added = engine.totals.num_preemptions, [0] * n, 0, 0
    window: dict[str, Any] | None = None
    t0 = last_report = time.perf_counter()

    def add(i: int) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=spec.outs[i], ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", spec.prompts[i], sp))
        spec.times[f"r{i}"] = [time.perf_counter() - t0]

    while added < min(limit, n):
        add(added)
        added += 1
    while engine.has_work() and time.perf_counter() < spec.deadline:
        result = engine.step_with_batch_queue()
        now = time.perf_counter() - t0
        for out in [] if result is None else result.outputs:
            i = int(out.req_id[1:])
            if out.new_token_ids and len(spec.times[out.req_id]) == 1:
                spec.times[out.req_id].append(now)
            tokens[i] += len(out.new_token_ids)
            if out.finished:
                spec.times[out.req_id].append(now)
                finished += 1
                if added < n:
                    add(added)
                    added += 1
        if spec.window_s is not None and window is None and now >= spec.window_s:
            window = window_figures(spec.window_s, now, sum(tokens), finished, reached=True)
            if spec.stop_at_window:
                break
        if spec.progress is not None and time.perf_counter() - last_report >= PROGRESS_EVERY_S:
            last_report = time.perf_counter()
            spec.progress(run_figures(spec, tokens, finished, last_report - t0, partial=True))
    seconds = time.perf_counter() - t0
    partial = finished < n
    if partial:
        _abort_rest(engine, [f"r{i}" for i in range(added)])
    figures = run_figures(spec, tokens, finished, seconds, partial)
    figures["preemptions"] = engine.totals.num_preemptions - preempted0
    if spec.window_s is not None:
        figures["window"] = window or window_figures(spec.window_s, seconds, sum(tokens), finished, reached=False)
    return figures


def window_figures(window_s: float, seconds: float, output_tokens: int, finished: int, reached: bool) -> dict[str, Any]:
    """A run's first ``window_s`` seconds: the output tokens counted when the first step that ended at or past
    ``window_s`` seconds from the run's start returned (``seconds``: then), over those seconds. ``reached``
    False: the run ended (finished or cut) before the window did, and the figures are the whole run's."""
    return {
        "window_s": window_s,
        "reached": reached,
        "seconds": round(seconds, 3),
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / max(seconds, 1e-9),
        "finished_requests": finished,
    }


def _abort_rest(engine: Any, req_ids: list[str]) -> None:
    """Abort the requests still in the engine and run the steps that tell the worker (``LLM._abort_all``)."""
    for req_id in req_ids:
        engine.abort_request(req_id)
    while engine.has_work():
        engine.step_with_batch_queue()


def run_figures(spec: RunSpec, tokens: list[int], finished: int, seconds: float, partial: bool) -> dict[str, Any]:
    """Output tokens/s over the run (every token produced, finished requests or not), and over the finished
    requests their latency, TTFT, TPOT (time per output token after the first) and latency per output token (the
    published figures' "ms per output token"): means, and medians of TTFT and TPOT."""
    done = {r: t for r, t in spec.times.items() if len(t) == 3}
    outs = {r: spec.outs[int(r[1:])] for r in done}
    ttft = [t[1] - t[0] for t in done.values()]
    tpot = [(t[2] - t[1]) / (outs[r] - 1) * 1e3 for r, t in done.items() if outs[r] > 1]
    per_token = [(t[2] - t[0]) / outs[r] * 1e3 for r, t in done.items()]
    total = sum(tokens)
    return {
        "requests": len(spec.prompts),
        "finished_requests": finished,
        "partial": partial,
        "concurrency": spec.concurrency,
        "output_tokens": total,
        "seconds": round(seconds, 3),
        "output_tok_s": total / max(seconds, 1e-9),
        "latency_s_mean": _mean([t[2] - t[0] for t in done.values()]),
        "ttft_s_mean": _mean(ttft),
        "ttft_s_median": _median(ttft),
        "tpot_ms_mean": _mean(tpot),
        "tpot_ms_median": _median(tpot),
        "ms_per_output_token": _mean(per_token),
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None
