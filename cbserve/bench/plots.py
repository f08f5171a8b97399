"""Figures of ``cbserve bench`` results (matplotlib, Agg backend, PNG): latency CDFs of several runs on one
figure, and throughput / latency versus offered load (runs sharing a label form one curve)."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CDF_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft", "TTFT (ms)"),
    ("tpot", "TPOT (ms)"),
    ("itl", "ITL (ms)"),
    ("e2el", "end-to-end latency (ms)"),
)


def load_results(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    runs = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if not isinstance(doc, dict) or "summary" not in doc:
            raise ValueError(f"{p}: not a cbserve bench result file")
        doc.setdefault("label", Path(p).stem)
        runs.append(doc)
    return runs


def per_request_values(run: dict[str, Any], metric: str) -> list[float]:
    """Milliseconds of one metric over a run's successful requests (ITL: every gap)."""
    reqs = [r for r in run.get("requests", []) if r.get("success")]
    if metric == "ttft":
        return [r["ttft"] * 1e3 for r in reqs]
    if metric == "e2el":
        return [r["latency"] * 1e3 for r in reqs]
    if metric == "itl":
        return [x * 1e3 for r in reqs for x in r.get("itl", [])]
    if metric == "tpot":
        return [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3
                for r in reqs if r.get("output_tokens", 0) > 1]
    raise ValueError(f"unknown metric {metric!r}")


def offered_load(run: dict[str, Any]) -> tuple[str, float]:
    """(axis name, x value) of a run: its request rate, else its concurrency cap, else its achieved rate."""
    cfg = run.get("config", {})
    rate = cfg.get("request_rate", "inf")
    rate = math.inf if rate in ("inf", None) else float(rate)
    if math.isfinite(rate):
        return "offered load (req/s)", rate
    if cfg.get("max_concurrency"):
        return "max concurrency", float(cfg["max_concurrency"])
    return "achieved load (req/s)", float(run["summary"]["request_throughput"])


def plot_runs(runs: Sequence[dict[str, Any]], out: str | os.PathLike[str], kind: str = "both",
              title: str | None = None, caption: str | None = None) -> None:
    """Draw ``runs`` into one PNG at ``out``: ``cdf`` = four latency-CDF panels, ``throughput`` = throughput
    and median / p90 latency versus load, ``both`` = the two rows together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("nothing to plot")
    if kind not in ("both", "cdf", "throughput"):
        raise ValueError(f"unknown plot kind {kind!r}")
    rows = 2 if kind == "both" else 1
    fig = plt.figure(figsize=(16, 4.2 * rows + (0.6 if caption else 0.2)))
    grid = fig.add_gridspec(rows, 4)
    if kind in ("both", "cdf"):
        axes = [fig.add_subplot(grid[0, i]) for i in range(4)]
        draw_cdfs(axes, runs)
    if kind in ("both", "throughput"):
        row = rows - 1
        draw_load_curves(fig.add_subplot(grid[row, 0:2]), fig.add_subplot(grid[row, 2:4]), runs)
    if title:
        fig.suptitle(title, fontsize=11)
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=8, ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05 if caption else 0, 1, 0.95 if title else 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def draw_cdfs(axes: Sequence[Any], runs: Sequence[dict[str, Any]]) -> None:
    for ax, (metric, xlabel) in zip(axes, CDF_METRICS, strict=True):
        for run in runs:
            xs = sorted(per_request_values(run, metric))
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=run["label"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of token gaps")
        ax.set_ylim(0, 1.02)
        if _wide_range(ax):
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)


def draw_load_curves(ax_tput: Any, ax_lat: Any, runs: Sequence[dict[str, Any]]) -> None:
    series: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    xlabel = "offered load"
    for run in runs:
        xlabel, x = offered_load(run)
        series[run["label"]].append((x, run["summary"]))
    for label, points in series.items():
        points.sort(key=lambda p: p[0])
        xs = [p[0] for p in points]
        ax_tput.plot(xs, [p[1]["output_throughput"] for p in points], marker="o", label=label)
        line = ax_lat.plot(xs, [p[1]["median_e2el_ms"] for p in points], marker="o", label=f"{label} median")
        ax_lat.plot(xs, [p[1]["p90_e2el_ms"] for p in points], marker="x", linestyle="--",
                    color=line[0].get_color(), label=f"{label} p90")
    ax_tput.set_xlabel(xlabel)
    ax_tput.set_ylabel("output throughput (tok/s)")
    ax_lat.set_xlabel(xlabel)
    ax_lat.set_ylabel("end-to-end latency (ms)")
    for ax in (ax_tput, ax_lat):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _wide_range(ax: Any) -> bool:
    lo, hi = None, None
    for line in ax.get_lines():
        xs = [x for x in line.get_xdata() if x > 0]
        if xs:
            lo = min(xs) if lo is None else min(lo, min(xs))
            hi = max(xs) if hi is None else max(hi, max(xs))
    return lo is not None and hi is not None and hi / lo > 50
