"""The plot of ``make gpu-check``'s speed figures, read off ``check.json``: decode step time per batch (CUDA
graphs and eager, medians, beside the copy-bandwidth roofline); the burst's output tokens/s through cbserve (as
served and with piecewise graphs) beside HF transformers' best static and continuous batching, labelled with
what they ran; each peer workload against the published figures it replicates, on this card; and FP8 weights
and KV cache against bf16 (decode step times beside bf16's, and the ratios the FP8 goals read).

    python benchmarks/plot_gpu_check.py                      # benchmarks/results/gpu/check.json -> check.png
    python benchmarks/plot_gpu_check.py --record other/check.json --out other/check.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "benchmarks" / "results" / "gpu" / "check.json"


def caption(rec: dict[str, Any]) -> str:
    """The card, the model and the software the figures were measured with."""
    hw, model = rec.get("hardware") or {}, rec.get("model") or {}
    return (
        f"{rec.get('device')}: copy {hw.get('copy_gb_s', 0):.0f} GB/s, bf16 GEMM {hw.get('gemm_tflops', 0):.0f} "
        f"TFLOP/s measured; {model.get('preset')} random {model.get('dtype')} weights, {model.get('backend')} "
        f"attention; torch {rec.get('torch')}, triton {rec.get('triton')}, transformers {rec.get('transformers')};"
        f" commit {str(rec.get('commit'))[:12]}"
    )


def burst_bars(rec: dict[str, Any]) -> list[tuple[str, float]]:
    """(label, output tokens/s) of each burst run the record holds (a run cut by its deadline: 0, "cut")."""
    hf, tput = rec.get("hf") or {}, rec.get("throughput") or {}
    static, cont = hf.get("static") or {}, hf.get("continuous_batching") or {}
    labels = {
        "cbserve": "cbserve",
        "cbserve_piecewise": "cbserve,\npiecewise graphs",
        "hf_static": f"HF static\n({(static.get('label') or {}).get('attn_implementation')}, "
        f"batch {static.get('batch')})",
        "hf_continuous_batching": f"HF continuous\n({(cont.get('label') or {}).get('attn_implementation')})",
    }
    return [
        (label + ("" if tput.get(key) else "\n(cut or not run)"), tput.get(key) or 0.0) for key, label in labels.items()
    ]


def peer_bars(rec: dict[str, Any]) -> list[tuple[str, float]]:
    """(label, measured / published on this card: above 1 is better) per peer workload and published figure."""
    bars = []
    for name, row in (rec.get("peers") or {}).items():
        for key, pub in (row.get("published") or {}).items():
            target, got = pub.get("on_this_card"), row.get(pub["metric"])
            if not target or not got:
                continue
            ratio = got / target if pub["metric"] == "output_tok_s" else target / got
            bars.append(
                (
                    f"{name}\nvs {key.split('_')[0]} {pub['card']} {pub['dtype']}"
                    + (" (cut)" if row.get("partial") else ""),
                    ratio,
                )
            )
    return bars


def fp8_bars(rec: dict[str, Any]) -> list[tuple[str, float]]:
    """(label, FP8 / bf16) of each figure ``fp8_vs_bf16`` sets side by side: decode step time (below 1: FP8 is
    faster) and the concurrency-250 window's output tokens/s (above 1: FP8 is faster)."""
    summary = rec.get("fp8_vs_bf16") or {}
    bars = []
    for key, row in summary.items():
        if key.startswith("decode_b") and row:
            bars.append((f"decode b={key.removeprefix('decode_b')}\nstep time ({row['path']})", row["ratio"]))
    window = summary.get("c250_window")
    if window and window["ratio"] is not None:
        bars.append((f"c250 1000/1000\nfirst {window['window_s']:g} s, tok/s", window["ratio"]))
    return bars


def _decode_panel(ax: Any, rec: dict[str, Any]) -> None:
    rows = rec.get("decode") or []
    batches = [str(r["batch"]) for r in rows]
    for key, label, style in (
        ("graph_ms", "cbserve, CUDA graphs", "o-"),
        ("eager_ms", "cbserve, eager", "s--"),
        ("roofline_ms", "roofline (weights + KV / copy bandwidth)", "k:"),
    ):
        ax.plot(batches, [r[key] or float("nan") for r in rows], style, label=label)
    fp8 = [r for r in (rec.get("fp8") or {}).get("decode") or [] if str(r["batch"]) in batches]
    if fp8:  # on bf16's batch axis
        key = "graph_ms" if all(r["graph_ms"] for r in fp8) else "eager_ms"
        ax.plot([str(r["batch"]) for r in fp8], [r[key] for r in fp8], "D", color="C3",
                label=f"cbserve FP8 weights + KV, {key.split('_')[0]}")  # fmt: skip
    ctx = rows[0]["context"] if rows else "?"
    ax.set(
        xlabel="requests in the decode step", ylabel="ms per step (median)", title=f"Decode step, {ctx}-token contexts"
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def _bar_panel(ax: Any, bars: list[tuple[str, float]], ylabel: str, title: str, fmt: str) -> None:
    if not bars:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
    labels, vals = [b[0] for b in bars], [b[1] for b in bars]
    drawn = ax.bar(labels, vals, color="#6699cc")
    for b, v in zip(drawn, vals, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, v, format(v, fmt), ha="center", va="bottom", fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.set_ylim(0, max(vals + [1.0]) * 1.2)
    ax.tick_params(axis="x", labelsize=7)


def plot(rec: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, mid, right, fp8) = plt.subplots(1, 4, figsize=(21, 4.8))
    _decode_panel(left, rec)
    work = (rec.get("model") or {}).get("workload") or {}
    _bar_panel(
        mid,
        burst_bars(rec),
        "output tokens / s",
        f"Burst: {work.get('num_requests')} requests, "
        f"{work.get('prompt_len')}-token prompts, {work.get('min_out')}-{work.get('max_out')} out",
        ".0f",
    )
    right.axhline(1.0, color="k", lw=0.8, ls=":")
    _bar_panel(
        right,
        peer_bars(rec),
        "measured / published on this card (>1: better)",
        "Peer workloads against their published figures",
        ".2f",
    )
    fp8.axhline(0.6, color="C3", lw=0.8, ls=":")
    fp8.axhline(1.4, color="C2", lw=0.8, ls=":")
    refused = (rec.get("fp8_vs_bf16") or {}).get("refused")
    _bar_panel(
        fp8,
        fp8_bars(rec),
        "FP8 / bf16 (goals: step time <= 0.6, tok/s >= 1.4)",
        "FP8 weights + KV cache against bf16" + (f"\n{refused[:60]}" if refused else ""),
        ".2f",
    )
    fig.text(0.01, 0.01, caption(rec), fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", type=Path, default=DEFAULT)
    p.add_argument("--out", type=Path, default=None, help="default: check.png beside the record")
    args = p.parse_args(argv)
    rec = json.loads(args.record.read_text(encoding="utf-8"))
    out = args.out or args.record.with_suffix(".png")
    plot(rec, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
