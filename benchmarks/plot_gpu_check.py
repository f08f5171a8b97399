"""The plot of ``make gpu-check``'s speed part: decode step time per batch (CUDA graphs, eager, the HBM
roofline) and the end-to-end burst's output tokens/s beside HF transformers on the same GPU, read off
``check.json``.

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
    return (f"{rec.get('device')}: copy {hw.get('copy_gb_s', 0):.0f} GB/s, bf16 GEMM {hw.get('gemm_tflops', 0):.0f} "
            f"TFLOP/s measured; {model.get('preset')} random {model.get('dtype')} weights, {model.get('backend')} "
            f"attention; torch {rec.get('torch')}, triton {rec.get('triton')}, transformers {rec.get('transformers')};"
            f" commit {str(rec.get('commit'))[:7]}")


def plot(rec: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = rec.get("decode") or []
    batches = [str(r["batch"]) for r in rows]
    for key, label, style in (("graph_ms", "cbserve, CUDA graphs", "o-"), ("eager_ms", "cbserve, eager", "s--"),
                              ("roofline_ms", "HBM roofline (weights + KV)", "k:")):
        left.plot(batches, [r[key] or float("nan") for r in rows], style, label=label)
    ctx = rows[0]["context"] if rows else "?"
    left.set(xlabel="requests in the decode step", ylabel="ms per step", title=f"Decode step, {ctx}-token contexts")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    tput = rec.get("throughput") or {}
    names = [("cbserve", "cbserve"), ("hf_continuous_batching", "HF continuous\nbatching"),
             ("hf_static", "HF static\nbatching")]
    vals = [tput.get(k) or 0.0 for k, _ in names]
    bars = right.bar([n for _, n in names], vals, color=["#cc5533", "#6699cc", "#999999"])
    for b, v in zip(bars, vals, strict=True):
        right.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
    work = (rec.get("model") or {}).get("workload") or {}
    right.set(ylabel="output tokens / s", title=f"Burst: {work.get('num_requests')} requests, "
              f"{work.get('prompt_len')}-token prompts, {work.get('min_out')}-{work.get('max_out')} out")
    right.set_ylim(0, max(vals + [1.0]) * 1.2)
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
