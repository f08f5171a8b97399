"""What ``check.json`` is judged by: the cards' vendor figures, the published figures the peer workloads
replicate (each with its source), their equivalent on the card the check ran on, and the goals read off the
merged record (``goals``; ``derived``: the record's summary keys, recomputed from the parts' own keys at every
save, never written by hand)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (name fragment, HBM bytes/s, dense bf16 FLOP/s) from the vendor's sheets; the first fragment found in the
# device's name wins ("H100" alone: the SXM card)
NOMINAL = (
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),
    ("A100", 2.0e12, 312e12),
)

PR_4407 = "https://github.com/NVIDIA/TensorRT-LLM/pull/4407"
TRTLLM_V1 = (
    "https://github.com/NVIDIA/TensorRT-LLM/blob/00f37686aa854010d68bcbd0f4ab000221541ca6/docs/source/"
    "performance/perf-overview.md"
)
TORCHAO = "https://github.com/pytorch/ao/blob/fd6e4b1f36d644de9b56be69ffe0f1a24b6ea111/torchao/quantization/README.md"

# FP8 against bf16 (issue 50's goals): the decode step at batch 1 at most this share of bf16's, the output tokens/s
# of the concurrency-250 workload's first seconds (its window, the same for both) at least this multiple
FP8_DECODE_B1_AT_MOST = 0.6
FP8_C250_WINDOW_AT_LEAST = 1.4
WINDOW_WORKLOAD = "c250_1000_1000"
FP8_ACCURACY_VARIANT = "fp8-both"  # bench_fp8_accuracy's name for FP8 weights and KV cache, as the group serves


@dataclass(frozen=True)
class Published:
    """A published figure: ``metric`` is "output_tok_s" (higher is better) or "ms_per_output_token" (a request's
    latency over its output tokens, lower is better); ``bound``: what scales it to another card ("bandwidth":
    HBM bytes/s, "compute": bf16 FLOP/s)."""

    engine: str
    model: str
    card: str  # a NOMINAL fragment
    dtype: str
    isl: int
    osl: int
    concurrency: int | None  # None: every request queued at once
    requests: int
    metric: str
    value: float
    bound: str
    source: str


_NANO = "Llama-3.1-Nemotron-Nano-8B-v1 (Llama-3.1-8B's shape)"
_FP8 = "nvidia/Llama-3.1-8B-Instruct-FP8"
PUBLISHED: dict[str, Published] = {
    "trtllm_pyt_h100_bf16_c250_1000_1000": Published(
        "TensorRT-LLM, PyTorch backend (PR 4407)",
        _NANO,
        "H100",
        "bf16",
        1000,
        1000,
        250,
        500,
        "output_tok_s",
        6058.94,
        "bandwidth",
        PR_4407,
    ),
    "trtllm_pyt_h100_bf16_c1_1000_1000": Published(  # average request latency 6,023.7 ms over 1,000 tokens
        "TensorRT-LLM, PyTorch backend (PR 4407)",
        _NANO,
        "H100",
        "bf16",
        1000,
        1000,
        1,
        8,
        "ms_per_output_token",
        6.0237,
        "bandwidth",
        PR_4407,
    ),
    "torchao_h100_bf16_b1": Published(  # 126.90 tokens/s, compiled generate.py, batch 1, a short prompt
        "torchao generate.py (gpt-fast)",
        "Meta-Llama-3.1-8B",
        "H100",
        "bf16",
        5,
        200,
        1,
        1,
        "ms_per_output_token",
        1e3 / 126.90,
        "bandwidth",
        TORCHAO,
    ),
    "trtllm_v1_h100_fp8_1000_1000": Published(
        "TensorRT-LLM 1.0, PyTorch backend",
        _FP8,
        "H100",
        "fp8",
        1000,
        1000,
        None,
        3000,
        "output_tok_s",
        15220,
        "bandwidth",
        TRTLLM_V1,
    ),
    "trtllm_v1_h200_fp8_1000_1000": Published(
        "TensorRT-LLM 1.0, PyTorch backend",
        _FP8,
        "H200",
        "fp8",
        1000,
        1000,
        None,
        3000,
        "output_tok_s",
        17744,
        "bandwidth",
        TRTLLM_V1,
    ),
    "trtllm_v1_h100_fp8_2048_128": Published(
        "TensorRT-LLM 1.0, PyTorch backend",
        _FP8,
        "H100",
        "fp8",
        2048,
        128,
        None,
        3000,
        "output_tok_s",
        3450,
        "compute",
        TRTLLM_V1,
    ),
    "trtllm_v1_h200_fp8_2048_128": Published(
        "TensorRT-LLM 1.0, PyTorch backend",
        _FP8,
        "H200",
        "fp8",
        2048,
        128,
        None,
        3000,
        "output_tok_s",
        3538,
        "compute",
        TRTLLM_V1,
    ),
}


def nominal(card_name: str) -> tuple[str, float, float] | None:
    """(the NOMINAL fragment, HBM bytes/s, bf16 FLOP/s) of a device name, or None for a card not listed."""
    return next(((frag, bw, fl) for frag, bw, fl in NOMINAL if frag in card_name), None)


def scaled(pub: Published, hw: dict[str, Any]) -> dict[str, Any]:
    """``pub`` beside its equivalent on the card of ``hw`` (the record's ``hardware``): unchanged on the same card;
    on another listed card scaled by the two cards' bandwidth (or bf16 compute, by ``pub.bound``), the published
    card's copy bandwidth taken as its nominal figure times the copy efficiency measured here (measured / nominal
    on this card): the ratio of the nominal figures. None where this card is not listed (the CPU of a dry run)."""
    here, there = nominal(hw.get("name") or ""), nominal(pub.card)
    row = {
        "engine": pub.engine,
        "model": pub.model,
        "card": pub.card,
        "dtype": pub.dtype,
        "metric": pub.metric,
        "value": pub.value,
        "source": pub.source,
        "requests": pub.requests,
        "concurrency": pub.concurrency,
    }
    if here is None or there is None:
        return {**row, "ratio": None, "on_this_card": None, "method": "this card has no vendor figures"}
    if here[0] == there[0]:
        return {**row, "ratio": 1.0, "on_this_card": pub.value, "method": "same card"}
    i, what = (1, "HBM bandwidth") if pub.bound == "bandwidth" else (2, "bf16 compute")
    ratio = here[i] / there[i]
    value = pub.value * ratio if pub.metric == "output_tok_s" else pub.value / ratio
    efficiency = (hw.get("copy_gb_s") or 0) * 1e9 / here[1] if pub.bound == "bandwidth" else None
    method = f"{what} {here[0]} / {there[0]} = {ratio:.3f}" + (
        f" ({pub.card} copy bandwidth estimated at this card's measured copy efficiency {efficiency:.2f})"
        if efficiency
        else ""
    )
    return {**row, "ratio": ratio, "on_this_card": value, "method": method}


def _peer_goal(rec: dict[str, Any], name: str, key: str) -> bool | None:
    """Whether peer workload ``name`` reached published figure ``key`` on this card: False when its run was cut
    by its deadline; None when it did not run or the figure has no equivalent here."""
    row = (rec.get("peers") or {}).get(name)
    if not row or "published" not in row:
        return None
    target = row["published"].get(key, {}).get("on_this_card")
    if target is None:
        return None
    if row.get("partial"):
        return False
    pub = PUBLISHED[key]
    got = row.get(pub.metric)
    if got is None:
        return None
    return got >= target if pub.metric == "output_tok_s" else got <= target


def _decode_vs(bf16_rows: list[dict[str, Any]], fp8_rows: list[dict[str, Any]], batch: int) -> dict[str, Any] | None:
    """FP8's decode step at ``batch`` against bf16's, the same way on both sides (CUDA graphs where both have
    them, else eager): the ratio of the medians (below 1: FP8 is faster); None where either row is missing."""
    bf16 = next((r for r in bf16_rows if r.get("batch") == batch), None)
    fp8 = next((r for r in fp8_rows if r.get("batch") == batch), None)
    if bf16 is None or fp8 is None:
        return None
    key = "graph_ms" if bf16.get("graph_ms") and fp8.get("graph_ms") else "eager_ms"
    return {
        "path": key.split("_")[0],
        "bf16_ms": bf16[key],
        "fp8_ms": fp8[key],
        "ratio": fp8[key] / bf16[key],
        "context": {"bf16": bf16.get("context"), "fp8": fp8.get("context")},
    }


def _window_vs(bf16_row: dict[str, Any], fp8_row: dict[str, Any]) -> dict[str, Any] | None:
    """FP8's output tokens/s over the concurrency-250 run's window against bf16's over the same window: None
    where either has none; ``ratio`` None unless both runs reached the same window."""
    bf16, fp8 = bf16_row.get("window"), fp8_row.get("window")
    if not bf16 or not fp8:
        return None
    same = bf16["reached"] and fp8["reached"] and bf16["window_s"] == fp8["window_s"]
    return {
        "window_s": fp8["window_s"],
        "bf16_output_tok_s": bf16["output_tok_s"],
        "fp8_output_tok_s": fp8["output_tok_s"],
        "reached": {"bf16": bf16["reached"], "fp8": fp8["reached"]},
        "ratio": fp8["output_tok_s"] / bf16["output_tok_s"] if same and bf16["output_tok_s"] else None,
    }


def fp8_vs_bf16(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The FP8 group's figures against bf16's (None: the group has not run; ``refused``: the card cannot run
    FP8): each decode row it timed (batch 1 and 64), the concurrency-250 window, greedy agreement and KL."""
    fp8 = rec.get("fp8")
    if not fp8:
        return None
    if fp8.get("refused"):
        return {"refused": fp8["refused"]}
    rows = fp8.get("decode") or []
    out: dict[str, Any] = {f"decode_b{r['batch']}": _decode_vs(rec.get("decode") or [], rows, r["batch"]) for r in rows}
    bf16_row = (rec.get("peers") or {}).get(WINDOW_WORKLOAD) or {}
    out["c250_window"] = _window_vs(bf16_row, (fp8.get("peers") or {}).get(WINDOW_WORKLOAD) or {})
    accuracy = fp8.get("accuracy") or {}
    variant = (accuracy.get("results") or {}).get(FP8_ACCURACY_VARIANT)
    out["accuracy"] = variant and {
        "model": accuracy.get("model"),
        **{k: variant[k] for k in ("greedy_prefix_agreement", "top1_agreement", "mean_kl", "max_kl")},
    }
    return out


def _fp8_goal(rec: dict[str, Any], key: str, met: Any) -> bool | str | None:
    """An FP8 goal: "not measurable: refused: ..." where the card cannot run FP8; None where part 2 has not
    run; False where it ran but the figure is missing or partial (a window not reached); else ``met(ratio)``."""
    summary = fp8_vs_bf16(rec)
    if summary and summary.get("refused"):
        return f"not measurable: {summary['refused']}"
    if "2" not in (rec.get("parts") or {}):
        return None
    row = (summary or {}).get(key)
    if key == "accuracy":
        return row is not None
    return bool(row and row["ratio"] is not None and met(row["ratio"]))


def goals(rec: dict[str, Any]) -> dict[str, Any]:
    """The goals, read off the merged record: True / False, None where not measured. A burst or peer run cut by
    its deadline (``partial``) has not met its goal. The FP8 goals (``_fp8_goal``): False where part 2 ran but
    left the figure missing or partial, a string saying why where the card cannot run FP8."""
    kt, eq = rec.get("kernel_tests") or {}, rec.get("greedy_equal") or {}
    frac, speed = rec.get("decode_roofline_fraction") or {}, rec.get("graphs_speedup") or {}
    burst = (rec.get("e2e") or {}).get("cbserve") or {}
    schedule = rec.get("burst_schedule") or {}
    return {
        "cuda_tests_pass": kt.get("passed", 0) > 0 and kt.get("failed", 1) == 0 if "note" not in kt else None,
        "every_family_greedy_equal_fp32": all(eq.values()) if eq and None not in eq.values() else None,
        "c250_1000_1000_at_least_trtllm": _peer_goal(rec, "c250_1000_1000", "trtllm_pyt_h100_bf16_c250_1000_1000"),
        "c1_1000_1000_ms_per_token_at_most_trtllm": _peer_goal(
            rec, "c1_1000_1000", "trtllm_pyt_h100_bf16_c1_1000_1000"
        ),
        "burst_85pct_of_ideal_schedule": None
        if not burst or "fraction" not in schedule
        else not burst.get("partial") and schedule["fraction"] >= 0.85,
        "decode_b64_80pct_of_copy_bandwidth": frac["64"] >= 0.8 if "64" in frac else None,
        "graphs_1.5x_eager_b1": speed["1"] >= 1.5 if "1" in speed else None,
        "fp8_decode_b1_at_most_0.6x_bf16": _fp8_goal(rec, "decode_b1", lambda r: r <= FP8_DECODE_B1_AT_MOST),
        "fp8_c250_window_at_least_1.4x_bf16": _fp8_goal(rec, "c250_window", lambda r: r >= FP8_C250_WINDOW_AT_LEAST),
        "fp8_accuracy_reported": _fp8_goal(rec, "accuracy", None),
        **_rl_goals(rec.get("rl") or {}),
        "kv_tiers_pinned_tokens_equal": _tiers_goal(rec.get("kv_tiers") or {}),
    }


def _tiers_goal(tiers: dict[str, Any]) -> bool | None:
    """Issue 52's CUDA tier (``gpu_check_tiers.py``): the greedy tokens with the RAM tier equal those without, and
    real-size blocks come back from pinned memory as stored (on a GPU the tier must be pinned)."""
    real = tiers.get("real_size_blocks") or {}
    if "tokens_equal" not in tiers or "loaded_equal_stored" not in real:
        return None
    return bool(tiers["tokens_equal"] and real["loaded_equal_stored"] and (tiers["device"] != "cuda" or real["pinned"]))


def _rl_goals(rl: dict[str, Any]) -> dict[str, bool | None]:
    """Issue 54's CUDA half (``gpu_check_rl.py``): sleep level 1 gives back >= 90% of the KV cache, wake_up under
    2 s, greedy tokens equal HF's after every wake and after a weight update."""
    one, update = rl.get("level1") or {}, rl.get("update") or {}
    runs = [rl.get("greedy_equal_before"), one.get("greedy_equal_after_wake"),
            (rl.get("level2") or {}).get("greedy_equal_after_wake"), update.get("greedy_equal")]  # fmt: skip
    return {
        "rl_sleep1_frees_90pct_of_kv": rl["level1_freed_over_kv"] >= 0.9 if "level1_freed_over_kv" in rl else None,
        "rl_wake_up_under_2s": one["wake_up_s"] < 2.0 if "wake_up_s" in one else None,
        "rl_greedy_equal_after_wake_and_update": all(runs) if None not in runs else None,
    }


def derived(rec: dict[str, Any]) -> dict[str, Any]:
    """The summary keys of the merged record: ``commit`` and ``device`` (the parts', "mixed: ..." when the parts
    ran apart), ``throughput`` (each burst's output tokens/s, None for a run cut by its deadline),
    ``fp8_vs_bf16`` and ``goals``."""
    parts = rec.get("parts") or {}
    out: dict[str, Any] = {key: _agreed(parts, key, rec.get(key)) for key in ("commit", "device")}
    e2e = rec.get("e2e") or {}
    hf = rec.get("hf") or {}
    runs = {
        "cbserve": e2e.get("cbserve"),
        "cbserve_piecewise": e2e.get("cbserve_piecewise"),
        "hf_continuous_batching": hf.get("continuous_batching"),
        "hf_static": hf.get("static"),
    }
    out["throughput"] = {k: None if not r or r.get("partial") else r.get("output_tok_s") for k, r in runs.items()}
    out["fp8_vs_bf16"] = fp8_vs_bf16(rec)
    out["goals"] = goals(rec)
    return out


def _agreed(parts: dict[str, Any], key: str, fallback: Any) -> Any:
    """The parts' common value of ``key``; "mixed: part 1 ..., part 2 ..." where they differ."""
    seen = {p.get(key) for p in parts.values() if p.get(key)}
    if len(seen) == 1:
        return seen.pop()
    if seen:
        return "mixed: " + ", ".join(f"part {n} {p.get(key)}" for n, p in sorted(parts.items()))
    return fallback
