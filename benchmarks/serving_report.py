"""Report of benchmarks/bench_serving.py: the goal ratios of issue 17, the printed table and the PNG figure."""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

WORKLOADS = ("burst", "poisson", "single")
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))


def _summary(results: dict[str, Any], server: str, workload: str) -> dict[str, Any] | None:
    """A workload's summary; for a burst run in rounds (--burst-rounds), each figure's median over the rounds."""
    rounds = results.get(server, {}).get("burst_rounds") if workload == "burst" else None
    if rounds and all(r.get("completed") for r in rounds):
        keys = [k for k, v in rounds[0].items() if isinstance(v, (int, float)) and all(r.get(k) is not None
                                                                                      for r in rounds)]
        return {k: median(r[k] for r in rounds) for k in keys}
    s = results.get(server, {}).get(workload, {}).get("summary")
    return s if s and s.get("completed") else None


def round_ratios(results: dict[str, Any], server: str, other: str) -> list[float] | None:
    """``server``'s burst output tok/s over ``other``'s, round by round (None without rounds on both sides)."""
    a, b = results.get(server, {}).get("burst_rounds"), results.get(other, {}).get("burst_rounds")
    if not a or not b or len(a) != len(b):
        return None
    return [x["output_throughput"] / y["output_throughput"] for x, y in zip(a, b, strict=True)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goal_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """The numbers the serving goals (issue 51: served >= 1.5x `vllm serve`, >= 0.85x offline) are stated in (None
    where a side is missing), with each goal."""
    cb, vl = _summary(results, "cbserve", "burst"), _summary(results, "vllm", "burst")
    off = _summary(results, "offline", "burst")
    cb1, ll1 = _summary(results, "cbserve", "single"), _summary(results, "llama", "single")

    def get(s: dict[str, Any] | None, key: str) -> float | None:
        return s.get(key) if s else None

    out: dict[str, Any] = {
        "burst_output_tput_cbserve_over_vllm": {
            "value": _ratio(get(cb, "output_throughput"), get(vl, "output_throughput")), "goal": ">= 1.5"},
        "burst_median_ttft_cbserve_over_vllm": {
            "value": _ratio(get(cb, "median_ttft_ms"), get(vl, "median_ttft_ms")), "goal": "< 1"},
        "burst_median_tpot_cbserve_over_vllm": {
            "value": _ratio(get(cb, "median_tpot_ms"), get(vl, "median_tpot_ms")), "goal": "< 1"},
        "burst_served_over_offline": {
            "value": _ratio(get(cb, "output_throughput"), get(off, "output_throughput")), "goal": ">= 0.85"},
        "single_median_tpot_cbserve_over_llama": {
            "value": _ratio(get(cb1, "median_tpot_ms"), get(ll1, "median_tpot_ms")), "goal": "<= 1"},
    }
    for k, v in out.items():
        val, goal = v["value"], v["goal"]
        if val is None:
            v["met"] = None
            continue
        op, _, num = goal.partition(" ")
        bound = float(num)
        v["met"] = {">=": val >= bound, "<": val < bound, "<=": val <= bound}[op]
        out[k] = v
    for key, other in (("burst_output_tput_cbserve_over_vllm", "vllm"), ("burst_served_over_offline", "offline")):
        out[key]["rounds"] = round_ratios(results, "cbserve", other)
    out["cbserve_burst_dispatch"] = dispatch_overhead(results.get("cbserve", {}).get("burst", {}))
    return out


def dispatch_overhead(burst: dict[str, Any]) -> dict[str, Any] | None:
    """Mean dispatch overhead per step (the step's hand-off: wall time minus forward) over the burst, from
    /stats before and after (replica 0)."""
    before, after = burst.get("stats_before"), burst.get("stats_after")
    try:
        b, a = before["replicas"][0], after["replicas"][0]
        calls = a["dispatch_calls"] - b["dispatch_calls"]
        total_ms = a["dispatch_calls"] * a["dispatch_overhead_ms_mean"] - \
            b["dispatch_calls"] * b["dispatch_overhead_ms_mean"]
    except (KeyError, IndexError, TypeError):
        return None
    duration_ms = burst["summary"]["duration_s"] * 1000.0
    return {"steps": calls, "mean_overhead_ms": total_ms / calls if calls else None,
            "mean_step_ms": duration_ms / calls if calls else None,
            "overhead_share": total_ms / duration_ms if duration_ms else None,
            "compiled_graph": a.get("compiled_graph")}


def format_report(doc: dict[str, Any]) -> str:
    results = doc["results"]
    head = (f"{'server':<9}{'workload':<9}{'ok':>6}{'out tok/s':>10}" +
            "".join(f"{n + ' med':>10}{n + ' p99':>10}" for _, n in METRICS) + "  (ms)")
    lines = [f"Serving benchmark on {doc['config'].get('cpu')} ({doc['config'].get('cores')} cores, cbserve's "
             f"{doc['config'].get('cpu_isa', '?')} kernels), "
             f"commit {doc['config'].get('commit')}, poisson rate {doc['config'].get('poisson_rate')}",
             "NOTE: a shared machine gives noisy numbers.", head, "-" * len(head)]
    for server, res in results.items():
        if "skipped" in res:
            lines.append(f"{server:<9}SKIPPED: {res['skipped']}")
            continue
        for wl in WORKLOADS:
            s = res.get(wl, {}).get("summary")
            if not s:
                continue
            row = f"{server:<9}{wl:<9}{str(s['completed']) + '/' + str(s['num_requests']):>6}"
            row += f"{s['output_throughput']:>10.1f}"
            for key, _ in METRICS:
                med, p99 = s.get(f"median_{key}_ms"), s.get(f"p99_{key}_ms")
                row += f"{med:>10.1f}{p99:>10.1f}" if med is not None else f"{'-':>10}{'-':>10}"
            lines.append(row)
        if res.get("burst_rounds"):
            tput = ", ".join(f"{r['output_throughput']:.1f}" for r in res["burst_rounds"])
            lines.append(f"{server:<9}burst rounds, out tok/s: {tput}")
    lines.append("")
    lines.append("Goals (issue 17):")
    for k, v in doc["ratios"].items():
        if k == "cbserve_burst_dispatch":
            continue
        val = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        met = {None: "", True: "met", False: "NOT met"}[v["met"]]
        rounds = f" (medians; rounds {', '.join(f'{r:.3f}' for r in v['rounds'])})" if v.get("rounds") else ""
        lines.append(f"  {k:<42}{val:>8}  goal {v['goal']:<7} {met}{rounds}")
    d = doc["ratios"].get("cbserve_burst_dispatch")
    if d and d.get("mean_overhead_ms") is not None:
        lines.append(f"  cbserve burst: {d['steps']} steps, mean step {d['mean_step_ms']:.1f} ms, dispatch "
                     f"overhead {d['mean_overhead_ms']:.2f} ms/step ({100 * d['overhead_share']:.1f}% of the "
                     f"burst), compiled graph {d['compiled_graph']}")
    lines += _cpu_lines(results.get("cbserve", {}).get("burst", {}))
    return "\n".join(lines)


def _cpu_lines(burst: dict[str, Any]) -> list[str]:
    from cbserve.bench.cpu_profile import format_cpu_table

    lines: list[str] = []
    if "cpu_breakdown" in burst:
        lines += ["", "cbserve burst, " + format_cpu_table(burst["cpu_breakdown"])]
    spy = burst.get("py_spy")
    if spy:
        if "error" in spy:
            lines.append(f"py-spy: {spy['error']}")
        else:
            lines.append(f"py-spy record of the SchedulerActor (pid {spy['pid']}, {spy['file']}), hottest frames:")
            lines += [f"  {share * 100:5.1f}%  {frame}" for frame, share in spy["top_frames"]]
    return lines


def plot_serving(doc: dict[str, Any], out: str | Path) -> None:
    """Top row: CDFs of the burst's TTFT, TPOT, ITL and e2e latency per server (of the first workload that ran
    when the burst did not); bottom row: output tok/s and median TPOT per workload and server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbserve.bench.plots import draw_cdfs

    results = {k: v for k, v in doc["results"].items() if "skipped" not in v}
    fig = plt.figure(figsize=(16, 8.6))
    grid = fig.add_gridspec(2, 4)
    ran = workloads_run(results)
    cdf_workload = ran[0] if ran else "burst"  # the burst's when it ran, else the first workload that did
    runs = [{**res[cdf_workload], "label": name} for name, res in results.items()
            if "requests" in res.get(cdf_workload, {})]
    if runs:
        draw_cdfs([fig.add_subplot(grid[0, i]) for i in range(4)], runs)
    for col, (key, ylabel) in enumerate((("output_throughput", "output tok/s"),
                                         ("median_tpot_ms", "median TPOT (ms)"))):
        _draw_bars(fig.add_subplot(grid[1, 2 * col:2 * col + 2]), results, key, ylabel)
    cfg = doc["config"]
    fig.suptitle(f"Serving benchmark, {cfg.get('cpu')} ({cfg.get('cores')} cores, cbserve's {cfg.get('cpu_isa', '?')} "
                 f"kernels), commit {cfg.get('commit')}; "
                 f"{cdf_workload} CDFs on top", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, format="png")
    plt.close(fig)


def workloads_run(results: dict[str, Any]) -> list[str]:
    """The workloads some server answered, in WORKLOADS' order."""
    return [w for w in WORKLOADS if any(_summary(results, s, w) for s in results)]


def bar_values(results: dict[str, Any], key: str) -> tuple[list[str], dict[str, list[tuple[int, float, list[float]]]]]:
    """The workloads that ran, and per server its bars: (workload index, ``key``'s value, each round's value).
    A burst run in rounds stands at its median over the rounds; offline has no TPOT, so no bar there."""
    ran = workloads_run(results)
    bars: dict[str, list[tuple[int, float, list[float]]]] = {}
    for name in results:
        for j, w in enumerate(ran):
            value = (_summary(results, name, w) or {}).get(key)
            if value:
                rounds = results[name].get("burst_rounds") if w == "burst" else None
                bars.setdefault(name, []).append((j, value, [r[key] for r in rounds or [] if r.get(key)]))
    return ran, bars


def _draw_bars(ax: Any, results: dict[str, Any], key: str, ylabel: str) -> None:
    """One group of bars per workload that ran, a colour per server (the same in both charts); a burst run in
    rounds shows its median, each round a dot."""
    ran, bars = bar_values(results, key)
    width = 0.8 / max(1, len(results))
    rounds_n = 0
    for i, name in enumerate(results):
        xs = [j + i * width for j, _, _ in bars.get(name, [])]
        if not xs:
            continue
        drawn = ax.bar(xs, [v for _, v, _ in bars[name]], width, label=name, color=f"C{i}")
        ax.bar_label(drawn, fmt="%.0f" if key == "output_throughput" else "%.1f", fontsize=8, label_type="center",
                     color="white")  # inside the bar: the rounds' dots sit at its top
        for x, (_, _, rounds) in zip(xs, bars[name], strict=True):
            if len(rounds) > 1:
                ax.plot([x] * len(rounds), rounds, "k.", markersize=4)
                rounds_n = max(rounds_n, len(rounds))
    labels = [f"{w}\n(median of {rounds_n} rounds, dots: each)" if w == "burst" and rounds_n else w for w in ran]
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ran))], labels)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    if bars:
        ax.legend(fontsize=8)
