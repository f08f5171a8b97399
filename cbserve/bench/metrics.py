"""Arrival schedules and the summary statistics of ``cbserve bench`` (pure functions, no I/O).

Definitions (as in vLLM's serving benchmark): TTFT = time to the first text chunk; TPOT = (e2e latency -
TTFT) / (output tokens - 1) for requests with more than one output token; ITL = every gap between text
chunks; e2e latency = send to last chunk. Goodput counts the completed requests that meet every SLO target
given (``ttft``, ``tpot``, ``e2el`` in milliseconds), per second of benchmark time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def arrival_times(num: int, request_rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send offsets (seconds from the start) of ``num`` requests: all zero for a burst
    (``request_rate`` = inf), else a Poisson process of that mean rate (gamma-distributed gaps with shape
    ``burstiness``; 1.0 is Poisson, lower is burstier). The first request goes at time 0."""
    if num < 0:
        raise ValueError("num must be >= 0")
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for i in range(num):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); 0.0 for an empty list."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values_s: Sequence[float], prefix: str) -> dict[str, float]:
    """mean / median / std / p90 / p99 of seconds, reported in milliseconds under ``{stat}_{prefix}_ms``."""
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms) if ms else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if ms else 0.0
    out = {f"mean_{prefix}_ms": mean, f"median_{prefix}_ms": percentile(ms, 50.0), f"std_{prefix}_ms": std}
    for q in PERCENTILES:
        if q != 50.0:
            out[f"p{q:g}_{prefix}_ms"] = percentile(ms, q)
    return out


def tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first, or None with fewer than two output tokens."""
    if output_tokens < 2:
        return None
    return (latency - ttft) / (output_tokens - 1)


def parse_goodput(spec: str | Iterable[str] | None) -> dict[str, float]:
    """``"ttft=500,tpot=50"`` (or ``ttft:500``, or a list of such items) -> {"ttft": 500.0, ...} in ms."""
    if not spec:
        return {}
    items = [spec] if isinstance(spec, str) else list(spec)
    out: dict[str, float] = {}
    for item in (p for s in items for p in s.split(",") if p.strip()):
        key, sep, value = item.replace(":", "=").partition("=")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"bad goodput target {item!r}: use ttft=MS, tpot=MS or e2el=MS")
        try:
            ms = float(value)
        except ValueError as e:
            raise ValueError(f"bad goodput target {item!r}: {value!r} is not a number") from e
        if ms <= 0:
            raise ValueError(f"goodput target {key} must be > 0 ms")
        out[key] = ms
    return out


def meets_slo(ttft_s: float, tpot_s: float | None, latency_s: float, slo_ms: dict[str, float]) -> bool:
    if "ttft" in slo_ms and ttft_s * 1000.0 > slo_ms["ttft"]:
        return False
    if "tpot" in slo_ms and tpot_s is not None and tpot_s * 1000.0 > slo_ms["tpot"]:
        return False
    return not ("e2el" in slo_ms and latency_s * 1000.0 > slo_ms["e2el"])


def summarize(results: Sequence[Any], duration_s: float, slo_ms: dict[str, float] | None = None) -> dict:
    """Aggregate per-request results (objects with ``success``, ``ttft``, ``latency``, ``itl``,
    ``prompt_tokens``, ``output_tokens``) over a run of ``duration_s`` seconds."""
    ok = [r for r in results if r.success]
    dur = max(duration_s, 1e-9)
    ttfts = [r.ttft for r in ok]
    lats = [r.latency for r in ok]
    tpots = [t for r in ok if (t := tpot(r.latency, r.ttft, r.output_tokens)) is not None]
    itls = [x for r in ok for x in r.itl]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    if slo_ms:
        good = sum(
            meets_slo(r.ttft, tpot(r.latency, r.ttft, r.output_tokens), r.latency, slo_ms) for r in ok
        )
        out["goodput_targets_ms"] = dict(slo_ms)
        out["good_requests"] = good
        out["request_goodput"] = good / dur
    for values, name in ((ttfts, "ttft"), (tpots, "tpot"), (itls, "itl"), (lats, "e2el")):
        out.update(describe(values, name))
    return out


def format_summary(summary: dict[str, Any], title: str = "Serving benchmark result") -> str:
    """The human-readable report printed at the end of a run."""
    rows = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total generated tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    if "request_goodput" in summary:
        rows.append(("Request goodput (req/s)", summary["request_goodput"]))
    lines = [f"{' ' + title + ' ':=^60}"]
    lines += [f"{k:<44}{_fmt(v):>16}" for k, v in rows]
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{stat.capitalize() + ' ' + name.upper() + ' (ms)':<44}"
                         f"{_fmt(summary[f'{stat}_{name}_ms']):>16}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
