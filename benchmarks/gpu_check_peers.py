"""Part 2's peer replicas: the workloads other engines published figures for, replicated on cbserve's offline
engine over the Llama-3.1-8B-shaped model with random bf16 weights (random prompt token ids, fixed input and
output lengths, EOS ignored: exactly replicable), each recorded beside the published figures it replicates, the
card each was measured on and their equivalent on this card (``gpu_check_goals.scaled``).

The published runs took minutes; the part has six. A workload keeps the published request count and concurrency
where it fits, runs to a deadline where it may not (``partial``: the goals read it as not met), and saves its
figures so far every few seconds (a part stopped at its limit keeps them). Each workload starts with a warm-up of
two short requests of its prompt length (not counted).

The concurrency-250 run also records its first ``WINDOW_S`` seconds (``gpu_check_engine.window_figures``): the
FP8 group (``gpu_check_fp8.py``) runs the same requests for that window only, and the goal compares the two."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from gpu_check_engine import RunSpec, StepTimeline, drive, new_engine, summarize
from gpu_check_goals import PUBLISHED, WINDOW_WORKLOAD, scaled
from gpu_rooflines import request_flops

# The window of the concurrency-250 run FP8 is compared on: its first seconds, in bf16 and in FP8 (a dry run: a
# few milliseconds of its tiny steps)
WINDOW_S = {False: 40.0, True: 0.01}


@dataclass(frozen=True)
class PeerWorkload:
    """``requests`` requests of ``isl`` random prompt tokens and ``osl`` output tokens, at most ``concurrency`` in
    the engine (None: all queued at once, the engine's ``max_num_seqs`` running), given at most ``cap_s`` seconds;
    ``published``: the keys of ``PUBLISHED`` it replicates."""

    name: str
    isl: int
    osl: int
    concurrency: int | None
    requests: int
    cap_s: float
    published: tuple[str, ...]
    how: str  # how it differs from the published run


def peer_workloads(dry_run: bool) -> list[PeerWorkload]:
    """In the order they run: the two short ones first, the 250-concurrency one last."""
    published = {
        "c1_1000_1000": ("trtllm_pyt_h100_bf16_c1_1000_1000", "torchao_h100_bf16_b1"),
        "max_2048_128": ("trtllm_v1_h100_fp8_2048_128", "trtllm_v1_h200_fp8_2048_128"),
        "c250_1000_1000": (
            "trtllm_pyt_h100_bf16_c250_1000_1000",
            "trtllm_v1_h100_fp8_1000_1000",
            "trtllm_v1_h200_fp8_1000_1000",
        ),
    }
    # name: (isl, osl, concurrency, requests, cap_s, how it differs from the published run)
    shapes: dict[str, tuple[int, int, int | None, int, float, str]] = {
        "c1_1000_1000": (1000, 1000, 1, 2, 30.0, "2 requests where the published run has 8 (each runs alone on "
                         "the card: the mean of 2 holds the same figure)"),
        "max_2048_128": (2048, 128, None, 512, 35.0, "512 requests where the published run has 3,000, all queued "
                         "at once as there; bf16 where the published figure is FP8"),
        # 90 s (gpu_check_speed.plan_s), less where the part is late (never into the piecewise and FP8 groups'
        # seconds): it needs 500,000 / 6,059 = 83 s at the H100 goal, 58 s at the H200's, so a run that needs
        # more fails its goal whether cut or not
        "c250_1000_1000": (1000, 1000, 250, 500, 90.0, "as published (500 requests, concurrency 250), to a "
                           "deadline: at most 90 s, before the piecewise and FP8 groups' seconds"),
    }  # fmt: skip
    if dry_run:  # the concurrency-4 run long enough (4 waves of 40 steps) to outlast its window
        shapes = {
            "c1_1000_1000": (24, 8, 1, 2, 20.0, "tiny shapes (a dry run)"),
            "max_2048_128": (48, 4, None, 6, 20.0, "tiny shapes (a dry run)"),
            "c250_1000_1000": (16, 40, 4, 16, 30.0, "tiny shapes (a dry run)"),
        }
    return [PeerWorkload(name, *shape[:5], published[name], shape[5]) for name, shape in shapes.items()]


def peer_prompts(w: PeerWorkload, vocab: int, seed: int) -> list[list[int]]:
    """``w.requests`` prompts of ``w.isl`` random token ids (never the special ids 0-2), seeded."""
    rng = random.Random(f"{seed}-{w.name}")
    return [[rng.randrange(3, vocab) for _ in range(w.isl)] for _ in range(w.requests)]


@dataclass(frozen=True)
class Window:
    """Record a run's first ``seconds`` (``RunSpec.window_s``); ``stop``: and end the run there."""

    seconds: float
    stop: bool = False


def run_peer(
    check: Any,
    w: PeerWorkload,
    executor: Any,
    serve_config: Any,
    hf_config: Any,
    hw: dict[str, Any],
    deadline: float,
    window: Window | None = None,
    dest: tuple[str, ...] = ("peers",),
) -> dict[str, Any]:
    """Warm up, then run ``w`` to ``deadline`` with a step timeline; its row (figures, published, timeline
    summary), saved under ``<dest>.<name>`` of the record as it goes (the figures so far every few seconds,
    ``partial``: a part stopped there fails the goal), the full timeline in ``timeline_<dest after peers>_<name>
    .json``. The prompts depend on the workload's name and the seed only: the same for every ``dest``."""
    prompts = peer_prompts(w, hf_config.vocab_size, serve_config.seed)
    t0 = time.perf_counter()
    drive(new_engine(serve_config, executor), RunSpec(prompts[:2], [8] * 2, None, deadline))
    warmup_s = time.perf_counter() - t0
    published = {key: scaled(PUBLISHED[key], hw) for key in w.published}
    base = {**asdict(w), "warmup_s": round(warmup_s, 2), "card": hw.get("name"), "published": published}
    peers = check.results
    for key in dest:
        peers = peers.setdefault(key, {})

    def progress(figures: dict[str, Any]) -> None:
        peers[w.name] = {**base, **figures, "running": True}
        check.save()

    spec = RunSpec(prompts, [w.osl] * w.requests, w.concurrency, deadline, progress)
    if window is not None:
        spec.window_s, spec.stop_at_window = window.seconds, window.stop
    timeline = StepTimeline(executor)
    with timeline.attached():
        figures = drive(new_engine(serve_config, timeline), spec)
    rows = timeline.rows()
    path = check.out / f"timeline_{'_'.join([*dest[:-1], w.name])}.json"
    path.write_text(json.dumps({"workload": w.name, "card": hw.get("name"), "steps": rows}) + "\n")
    flops_per_token = request_flops(hf_config, w.isl, w.osl) / w.osl
    figures["achieved_tflops"] = figures["output_tok_s"] * flops_per_token / 1e12
    row = {
        **base,
        **figures,
        "timeline": {**summarize(rows), "file": path.name},
    }
    peers[w.name] = row
    check.save()
    return row


def run_peers(
    check: Any, executor: Any, serve_config: Any, hf_config: Any, hw: dict[str, Any], dry_run: bool, reserve_s: float
) -> None:
    """Every peer workload as a guarded sub-step, each to the earlier of its cap and the part's budget less
    ``reserve_s`` (the seconds the groups after the peers are planned to take); the concurrency-250 run records
    its first ``WINDOW_S`` seconds."""
    for w in peer_workloads(dry_run):
        seconds = min(w.cap_s, check.remaining() - reserve_s)
        window = Window(WINDOW_S[dry_run]) if w.name == WINDOW_WORKLOAD else None
        row = check.step(
            f"peers.{w.name}",
            run_peer,
            check,
            w,
            executor,
            serve_config,
            hf_config,
            hw,
            time.perf_counter() + seconds,
            window,
            min_s=reserve_s + (10 if dry_run else 30),
        )
        if row is None:
            continue
        check.log(
            f"  {w.name}: {row['output_tok_s']:.0f} output tok/s, "
            f"{row['ms_per_output_token'] or float('nan'):.2f} ms per output token, "
            f"{row['achieved_tflops']:.1f} TFLOP/s, {row['finished_requests']}/{row['requests']} requests"
            f"{' (cut by its deadline)' if row['partial'] else ''}, {row['preemptions']} preemptions"
            + (f"; {window_text(row['window'])}" if "window" in row else "")
        )


def window_text(window: dict[str, Any]) -> str:
    """A log line's words for a run's window figures."""
    return (
        f"its first {window['window_s']:g} s: {window['output_tok_s']:.0f} output tok/s "
        f"({window['output_tokens']} tokens in {window['seconds']:.2f} s"
        f"{'' if window['reached'] else ', the run ended before the window'})"
    )
