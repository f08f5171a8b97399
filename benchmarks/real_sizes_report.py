"""Tables and plot of benchmarks/bench_real_sizes.py: per size and system, the medians over the rounds, the weight
bytes a decode step reads against the machine's bandwidths and one request's prefill FLOP/s against its FMA
peak."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from real_models import SIZES, Shape

# Bytes a weight takes in what each system streams per decode step. GGUF Q8_0: 34 bytes a block of 32, Q4_0: 18;
# cbserve's panels hold the same blocks with the same float16 scales (csrc/panels.h), bfloat16 products read
# bfloat16 pairs; vLLM's bfloat16 weights.
BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_0": 18 / 32, "bf16": 2.0}


def layer_weights(shape: Shape) -> int:
    """Weights of every decoder layer's linear products."""
    hd = shape.head_dim
    qkv = shape.hidden * (shape.heads + 2 * shape.kv_heads) * hd
    return shape.layers * (qkv + shape.heads * hd * shape.hidden + 3 * shape.hidden * shape.inter)


def decode_bytes(shape: Shape, fmt: str, file_bytes: float | None = None) -> float:
    """Weight bytes one decode step reads: every layer's products and the LM head (the KV cache of a short
    context and the norms are under 2% of it); ``file_bytes`` where the format mixes block types (Q4_K_M: what
    ``gguf_step_bytes`` counts in its file)."""
    if file_bytes is not None:
        return file_bytes
    return (layer_weights(shape) + shape.vocab * shape.hidden) * BYTES_PER_WEIGHT[fmt]


def gguf_step_bytes(path: Path) -> int:
    """The bytes of a GGUF file's matrices a decode step reads: all 2-D tensors but the token embedding of a
    model with its own output matrix (a step reads one row of it)."""
    from gguf import GGUFReader

    matrices = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors if len(t.shape) == 2}
    if "output.weight" in matrices:
        matrices.pop("token_embd.weight", None)
    return sum(matrices.values())


def prefill_flops(shape: Shape, tokens: int) -> float:
    """FLOPs of one request's prefill: the layers' products for every token, attention over the causal half of
    the tokens x tokens scores, the LM head for the last token."""
    attn = 2 * 2 * shape.layers * shape.heads * shape.head_dim * tokens * (tokens + 1) / 2
    return 2 * layer_weights(shape) * tokens + attn + 2 * shape.vocab * shape.hidden


def _median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def medians(size_doc: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """system label -> {workload figure: median over the rounds} for the figures the tables use."""
    out: dict[str, dict[str, float | None]] = {}
    for label in {lbl for r in size_doc["rounds"] for lbl in r}:
        runs = [r[label] for r in size_doc["rounds"] if label in r and "burst" in r[label]]
        if not runs:
            continue
        fig = {
            "burst_tok_s": _median([r["burst"]["output_throughput"] for r in runs]),
            "burst_ttft_ms": _median([r["burst"]["median_ttft_ms"] for r in runs]),
            "burst_tpot_ms": _median([r["burst"]["median_tpot_ms"] for r in runs]),
            "single_ttft_ms": _median([r["single"]["median_ttft_ms"] for r in runs]),
            "single_tpot_ms": _median([r["single"]["median_tpot_ms"] for r in runs]),
            "load": _median([r[w]["load_before"] for r in runs for w in ("burst", "single")]),
            "rounds": len(runs),
        }
        fig["burst_rounds"] = [round(r["burst"]["output_throughput"], 2) for r in runs]
        fig["single_tpot_rounds"] = [round(r["single"]["median_tpot_ms"], 1) for r in runs]
        fig["step_bytes"] = size_doc.get("step_bytes", {}).get(label.split()[-1])
        out[label] = fig
    return out


def derived(size: str, label: str, fig: dict[str, Any], machine: dict[str, Any], input_len: int) -> dict[str, Any]:
    """Decode GB/s of one request and its share of the copy / read bandwidths; prefill GFLOP/s and its share of
    the FMA peak."""
    shape, fmt = SIZES[size], label.split()[-1]
    tpot, ttft = fig.get("single_tpot_ms"), fig.get("single_ttft_ms")
    gbs = decode_bytes(shape, fmt, fig.get("step_bytes")) / tpot / 1e6 if tpot else None
    gflops = prefill_flops(shape, input_len) / ttft / 1e6 if ttft else None
    copy, read, peak = machine.get("copy_gbs"), machine.get("read_gbs"), machine.get("fma_peak_gflops")
    return {
        "decode_gbs": gbs,
        "copy_share": gbs / copy if gbs and copy else None,
        "read_share": gbs / read if gbs and read else None,
        "prefill_gflops": gflops,
        "peak_share": gflops / peak if gflops and peak else None,
    }


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def format_tables(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"{m['cpu']}: FMA peak {_f(m.get('fma_peak_gflops'))} GFLOP/s, copy {_f(m.get('copy_gbs'))} GB/s, "
        f"read {_f(m.get('read_gbs'))} GB/s",
        "",
    ]
    input_len = doc["config"]["input_len"]
    for size, sd in doc["sizes"].items():
        lines += [
            f"### {size} ({sd['params'] / 1e9:.2f}B parameters)",
            "",
            "| system | burst out tok/s (rounds) | burst TTFT / TPOT (ms) | single TTFT / TPOT (ms) "
            "| decode GB/s (copy / read share) | prefill GFLOP/s (FMA peak share) | load |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, fig in sorted(medians(sd).items()):
            d = derived(size, label, fig, m, input_len)
            rounds = ", ".join(f"{v:.1f}" for v in fig["burst_rounds"])
            lines.append(
                f"| {label} | {_f(fig['burst_tok_s'])} ({rounds}) | {_f(fig['burst_ttft_ms'], '{:.0f}')} / "
                f"{_f(fig['burst_tpot_ms'])} | {_f(fig['single_ttft_ms'], '{:.0f}')} / {_f(fig['single_tpot_ms'])} | "
                f"{_f(d['decode_gbs'])} ({_f(d['copy_share'], '{:.0%}')} / {_f(d['read_share'], '{:.0%}')}) | "
                f"{_f(d['prefill_gflops'], '{:.0f}')} ({_f(d['peak_share'], '{:.0%}')}) | "
                f"{_f(fig['load'], '{:.2f}')} |"
            )
        skipped = {lbl: r[lbl]["skipped"] for r in sd["rounds"] for lbl in r if "skipped" in r[lbl]}
        lines += [f"- {lbl}: {why}" for lbl, why in sorted(skipped.items())] + [""]
    return "\n".join(lines)


def plot_real_sizes(doc: dict[str, Any], out: str | Path) -> None:
    """Per size: burst output tok/s per system (left), one request's decode GB/s against the bandwidths
    (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, input_len = doc["machine"], doc["config"]["input_len"]
    sizes = list(doc["sizes"])
    figs = {s: medians(doc["sizes"][s]) for s in sizes}
    labels = sorted({lbl for f in figs.values() for lbl in f})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs = [j + i * width for j, s in enumerate(sizes) if label in figs[s]]
        tok = [figs[s][label]["burst_tok_s"] or 0 for s in sizes if label in figs[s]]
        gbs = [derived(s, label, figs[s][label], m, input_len)["decode_gbs"] or 0 for s in sizes if label in figs[s]]
        ax1.bar(xs, tok, width, label=label)
        ax2.bar(xs, gbs, width, label=label)
    for ax in (ax1, ax2):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], sizes)
    for value, name, style in ((m.get("copy_gbs"), "copy bandwidth", "--"), (m.get("read_gbs"), "read bandwidth", ":")):
        if value:
            ax2.axhline(value, color="k", linestyle=style, linewidth=1, label=f"{name} {value:.0f} GB/s")
    ax1.set_ylabel("burst output tokens/s")
    ax1.set_title(f"burst of {doc['config']['burst']} requests ({input_len} in, {doc['config']['output_len']} out)")
    ax2.set_ylabel("weight GB read per second, one request")
    ax2.set_title("decode: weight bytes per step / TPOT")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{m['cpu']}; random weights of real shapes")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
