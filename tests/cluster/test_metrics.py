"""cluster/ops/metrics.py (and metric_specs.py) and dashboards/ agree (fast: no Ray cluster, no Prometheus).

- every series a dashboard queries is one the code exports (ray_cbserve_*) or one Ray Serve exports
  (ray_serve_*), and every cbserve metric is charted on some panel;
- the dashboard JSON is valid, importable (schemaVersion, unique ids, grid) and has its variables;
- the committed JSON is exactly what dashboards/generate.py writes;
- EngineMetrics / WorkerMetrics / IngressMetrics turn stats dataclasses into the right observations;
- no "No data" on a healthy cluster: constructing them creates, at 0, every counter and gauge series a
  dashboard selects (label matchers included); histograms appear with the first request.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from metric_recorders import _values, recorded

from cbserve.cluster.ingress.router import RoutingStats
from cbserve.cluster.ops import metric_specs as ms
from cbserve.cluster.ops import metrics as cm
from cbserve.scheduler.stats import (
    FinishedRequestStats,
    IterationStats,
    RequestTimes,
    SchedulerStats,
    SpecDecodeStats,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by",
    "without", "on", "ignoring", "and", "or", "unless", "vector", "clamp_min", "clamp_max", "topk",
    "bottomk", "abs", "offset", "bool", "label_values", "quantile", "delta", "deriv", "time", "scalar",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges and grouping removed)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end() :].lstrip()
        if m.group() in _KEYWORDS or rest.startswith("("):
            continue
        names.add(m.group())
    return names


def test_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, route)(rate(ray_cbserve_x_bucket{model=~"$model", a="b{c}"}'
        "[$__rate_interval]))) / sum(rate(ray_cbserve_y_total[1m])) or vector(0)"
    )
    assert metric_names(expr) == {"ray_cbserve_x_bucket", "ray_cbserve_y_total"}
    assert metric_names('max by (replica)(ray_a{model=~"$model"})') == {"ray_a"}


_SELECTOR = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\})?')
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
Matcher = tuple[str, str, str]


def selectors(expr: str) -> list[tuple[str, list[Matcher]]]:
    """(metric name, label matchers) of every series selector of a PromQL expression."""
    names = metric_names(expr)
    return [(m.group(1), _MATCHER.findall(m.group(2) or "")) for m in _SELECTOR.finditer(expr)
            if m.group(1) in names]  # fmt: skip


def matches(labels: dict[str, str], matchers: list[Matcher]) -> bool:
    """Prometheus semantics (regexes anchored, a missing label is ""), dashboard variables = All (.*)."""
    for key, op, value in matchers:
        value = re.sub(r"\$\{?\w+\}?", ".*", value)
        actual = labels.get(key, "")
        ok = {"=": actual == value, "!=": actual != value}.get(op, re.fullmatch(value, actual) is not None)
        if ok == (op == "!~"):
            return False
    return True


def test_selectors_parser() -> None:
    expr = (
        'sum by (route)(rate(ray_cbserve_h_total{model=~"$model", status!~"2..", a="}"}[5m]))'
        " / sum(ray_cbserve_g)"
    )
    assert selectors(expr) == [
        ("ray_cbserve_h_total", [("model", "=~", "$model"), ("status", "!~", "2.."), ("a", "=", "}")]),
        ("ray_cbserve_g", []),
    ]
    m = selectors(expr)[0][1]
    assert matches({"model": "x", "status": "404", "a": "}"}, m)
    assert not matches({"model": "x", "status": "200", "a": "}"}, m)
    assert not matches({"model": "x", "status": "404"}, m)
    assert matches({"reason": "abort"}, [("reason", "=~", "abort|error")])
    assert not matches({"reason": "stop"}, [("reason", "=~", "abort|error")])
    assert not matches({"reason": "stop"}, [("reason", "!=", "stop")])


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def iter_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def all_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every query of every panel."""
    return [
        (name, p["title"], t["expr"])
        for name, dash in load_dashboards().items()
        for p in iter_panels(dash)
        for t in p.get("targets", [])
    ]


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, variable name, series expression) of every label_values() template variable."""
    return [
        (name, v["name"], v["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0])
        for name, dash in load_dashboards().items()
        for v in dash["templating"]["list"]
        if v["type"] == "query"
    ]


def ray_serve_metric_names() -> set[str]:
    """Names Ray Serve registers (``serve_*`` in its source, f-strings over the protocol included), as
    exported: ``ray_`` + name (+ suffixes)."""
    spec = importlib.util.find_spec("ray.serve")
    assert spec is not None and spec.submodule_search_locations
    src = Path(next(iter(spec.submodule_search_locations)))
    names: set[str] = set()
    for path in src.rglob("*.py"):
        for name in re.findall(r'"(serve_[a-z0-9_{}]+)"', path.read_text(errors="replace")):
            names.update(name.replace("{protocol_name}", p) for p in ("http", "grpc"))
    suffixes = ("", "_total", "_bucket", "_sum", "_count")
    return {f"ray_{n}{s}" for n in names for s in suffixes}


def test_dashboards_exist_and_are_generated_by_the_script() -> None:
    spec = importlib.util.spec_from_file_location("cbserve_dash_gen", DASHBOARDS / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    built = gen.build_all()
    assert set(built) == set(load_dashboards()), "a dashboard JSON without generator (or vice versa)"
    for name, data in built.items():
        committed = (DASHBOARDS / name).read_text()
        assert committed == gen.render(data), f"{name} is stale: run python dashboards/generate.py"


@pytest.mark.parametrize("name", sorted(p.name for p in DASHBOARDS.glob("*.json")))
def test_dashboard_json_is_importable(name: str) -> None:
    dash = load_dashboards()[name]
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] and dash["title"]
    panels = iter_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"], f"panel {p['title']!r} has no query"
            assert p["datasource"]["uid"] == "${datasource}"
            ref_ids = [t["refId"] for t in p["targets"]]
            assert len(ref_ids) == len(set(ref_ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for v in variables.values():
        if v["type"] == "query":
            assert v["query"]["query"].startswith("label_values(")


def test_engine_dashboard_has_model_and_replica_variables() -> None:
    variables = {v["name"]: v for v in load_dashboards()["cbserve.json"]["templating"]["list"]}
    for name in ("model", "replica"):
        assert variables[name]["type"] == "query"
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
        q = variables[name]["query"]["query"]
        assert re.fullmatch(rf"label_values\((ray_cbserve_\w+)(\{{.*\}})?, {name}\)", q), q
        assert metric_names(q.removeprefix("label_values(").rsplit(",", 1)[0]) <= ms.exported_names()


def test_every_queried_series_is_exported() -> None:
    exported = ms.exported_names()
    serve = ray_serve_metric_names()
    for dash, title, expr in all_exprs():
        names = metric_names(expr)
        assert names, f"{dash} / {title}: no metric in {expr!r}"
        for n in names:
            if n.startswith("ray_cbserve_"):
                assert n in exported, f"{dash} / {title}: {n} is not exported by cluster/ops/metric_specs.py"
            else:
                assert n in serve, f"{dash} / {title}: {n} is neither a cbserve nor a Ray Serve metric"


def test_every_cbserve_metric_is_charted() -> None:
    queried = {n for _, _, expr in all_exprs() for n in metric_names(expr)}
    for spec in ms.ALL_SPECS:
        assert set(spec.exported_series()) & queried, f"{spec.exported} is on no panel"


def test_specs_are_valid_and_bounded() -> None:
    names = [s.name for s in ms.ALL_SPECS]
    assert len(names) == len(set(names))
    allowed = {"model", "replica", "rank", "reason", "route", "status", "position", "lora_name", "decision",
               "medium", "direction", *ms.LORA_INFO_LABELS}
    for s in ms.ALL_SPECS:
        assert re.fullmatch(r"cbserve_[a-z0-9_]+", s.name), s.name
        assert s.exported.startswith("ray_cbserve_")
        assert set(s.labels) <= allowed and "model" in s.labels, s.name
        assert not s.name.endswith("_total"), "Ray adds _total to counters"
        if s.kind == "histogram":
            assert list(s.buckets) == sorted(set(s.buckets)) and s.buckets[0] > 0
            assert not s.initial, "an empty histogram cannot be exported"
        else:
            assert s.initial, f"{s.name}: a counter or gauge is created at 0 at start-up"
        defaults = {"model", "replica", "rank"}
        assert all(set(labels) == set(s.labels) - defaults for labels in s.initial), s.name
    for b in (ms.REQUEST_LATENCY_BUCKETS, ms.TOKEN_LATENCY_BUCKETS):  # ms to minutes
        assert b[0] <= 0.005 and b[-1] >= 60


# ---- the mapping from stats to observations, with Ray's metric classes replaced by recorders ------------
@pytest.fixture()
def log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, dict[str, str]]]:
    return recorded(monkeypatch)


def test_engine_metrics_zero_initialise_counters_and_gauges(log: list) -> None:
    cm.EngineMetrics("m", "1")
    assert _values(log, "num_preemptions") == [0.0]
    assert _values(log, "kv_cache_usage_ratio") == [0.0]
    finished = {t["reason"] for n, _, t in log if n == "cbserve_request_finished"}
    assert finished == set(ms.FINISH_REASONS)
    assert all(t["model"] == "m" and t["replica"] == "1" for _, _, t in log)


def test_engine_metrics_observe_step(log: list) -> None:
    em = cm.EngineMetrics("m", "0")
    log.clear()
    times = RequestTimes(arrival=0.0, first_scheduled=0.5, first_token=1.0, last_token=3.0, finished=3.0,
                         num_prompt_tokens=7, num_generation_tokens=5)  # fmt: skip
    sched = SchedulerStats(
        num_running=3, num_waiting=2, num_preempted_waiting=1, kv_cache_usage=0.25, num_kv_blocks=100,
        num_free_kv_blocks=75, prefix_cache_queries=32, prefix_cache_hits=16, num_prefill_tokens=40,
        num_decode_tokens=3, num_preemptions=1, batch_size=4, schedule_time_s=0.001, execute_time_s=0.02,
    )  # fmt: skip
    it = IterationStats(
        num_generation_tokens=4, num_prompt_tokens=7, ttfts=[1.0], inter_token_latencies=[0.1, 0.2],
        finished=[FinishedRequestStats("length", times)], rejected_reasons=["prompt too long"],
        num_embedding_requests=2,
    )  # fmt: skip

    class Result:
        outputs: list = []
        scheduler_stats = sched
        iteration_stats = it

    em.observe_step(Result(), 0.004)
    assert _values(log, "num_requests_running") == [3.0]
    assert _values(log, "kv_cache_usage_ratio") == [0.25]
    assert _values(log, "prefix_cache_hits") == [16.0]
    assert _values(log, "embedding_requests") == [2.0]
    assert _values(log, "iteration_prefill_tokens") == [40.0]
    assert _values(log, "iteration_tokens") == [43.0]
    assert _values(log, "iteration_batch_size") == [4.0]
    assert _values(log, "engine_step_seconds") == [pytest.approx(0.021)]
    assert _values(log, "dispatch_overhead_seconds") == [0.004]
    assert _values(log, "time_to_first_token_seconds") == [1.0]
    assert _values(log, "inter_token_latency_seconds") == [0.1, 0.2]
    assert _values(log, "e2e_request_latency_seconds") == [3.0]
    assert _values(log, "request_queue_time_seconds") == [0.5]
    assert _values(log, "request_prefill_time_seconds") == [0.5]
    assert _values(log, "request_decode_time_seconds") == [2.0]
    assert _values(log, "time_per_output_token_seconds") == [0.5]
    assert [t["reason"] for n, _, t in log if n == "cbserve_request_finished"] == ["length"]
    assert _values(log, "request_rejected") == [], "rejections are counted by observe_rejected only"

    log.clear()  # an idle step: gauges are updated, step histograms and zero counters are not touched
    idle = type("Idle", (), {"scheduler_stats": SchedulerStats(), "iteration_stats": IterationStats()})
    em.observe_step(idle, 0)
    assert _values(log, "num_requests_running") == [0.0]
    assert not _values(log, "engine_step_seconds") and not _values(log, "prompt_tokens")


def test_engine_metrics_observe_speculative_decoding(log: list) -> None:
    em = cm.EngineMetrics("m", "0")
    assert {t["position"] for n, _, t in log if n == "cbserve_spec_decode_num_accepted_tokens_per_pos"} == {
        "0", "1", "2", "3"}  # fmt: skip
    log.clear()
    spec = SpecDecodeStats()
    spec.record(4, 3)
    spec.record(4, 1)
    spec.record(20, 17)  # positions past the bounded label share "15+"
    stats = SchedulerStats(batch_size=3, num_decode_tokens=31, spec_decode=spec)
    em.observe_step(type("R", (), {"scheduler_stats": stats, "iteration_stats": IterationStats()}), 0.0)
    assert _values(log, "spec_decode_num_drafts") == [3.0]
    assert _values(log, "spec_decode_num_draft_tokens") == [28.0]
    assert _values(log, "spec_decode_num_accepted_tokens") == [21.0]
    per_pos: dict[str, float] = {}
    for n, v, t in log:
        if n == "cbserve_spec_decode_num_accepted_tokens_per_pos":
            per_pos[t["position"]] = per_pos.get(t["position"], 0) + v
    assert per_pos["0"] == 3 and per_pos["1"] == 2 and per_pos["2"] == 2 and per_pos["3"] == 1
    assert per_pos["15+"] == 2 and set(per_pos) <= set(ms.SPEC_POSITIONS)
    log.clear()  # a step without drafts records none
    em.observe_step(type("R", (), {"scheduler_stats": SchedulerStats(batch_size=1), "iteration_stats":
                                   IterationStats()}), 0.0)  # fmt: skip
    assert not _values(log, "spec_decode_num_drafts")


def test_rejected_and_http_labels_stay_bounded(log: list) -> None:
    em, ing, wm = cm.EngineMetrics("m", "0"), cm.IngressMetrics("m"), cm.WorkerMetrics("m", "0", 1)
    log.clear()
    em.observe_rejected("queue_full")
    em.observe_rejected("prompt of 5000 tokens is longer than max_model_len 2048")
    assert [t["reason"] for n, _, t in log if n == "cbserve_request_rejected"] == ["queue_full", "other"]
    ing.observe_http("/v1/completions", 400, 0.01)
    ing.observe_http("/no/such/path/123", 404, 0.01)
    routes = [(t["route"], t["status"]) for n, _, t in log if n == "cbserve_http_requests"]
    assert routes == [("/v1/completions", "400"), ("other", "404")]
    ing.refresh(1)
    ing.refresh(2)
    ing.refresh(1)
    assert _values(log, "http_requests_in_flight") == [1.0, 2.0, 1.0]
    wm.observe_forward(0.03)
    assert [(v, t["rank"]) for n, v, t in log if n == "cbserve_worker_forward_seconds"] == [(0.03, "1")]
    ing.observe_routing(RoutingStats({"cache_hit": 3, "affinity": 1}, {64: 2, 0: 1}))  # the router's decisions
    decisions = sorted((t["decision"], v) for n, v, t in log if n == "cbserve_routing_decisions")
    assert decisions == [("affinity", 1.0), ("cache_hit", 3.0)]
    assert sorted(_values(log, "routing_matched_prefix_tokens")) == [0.0, 64.0, 64.0]


def test_every_dashboard_series_exists_at_zero_before_traffic(log: list) -> None:
    """A healthy cluster that served nothing yet: every counter and gauge series a panel or variable selects
    (its label matchers included, e.g. reason=~"abort|error", status!~"2..") exists at 0."""
    cm.EngineMetrics("m", "0"), cm.WorkerMetrics("m", "0", 0), cm.IngressMetrics("m")
    assert log and all(v == 0.0 for _, v, _ in log), "construction records zeros only"
    specs = {s.name: s for s in ms.ALL_SPECS}
    started: dict[str, list[dict[str, str]]] = defaultdict(list)
    for name, _, tags in log:
        started[specs[name].exported].append(tags)
    histograms = {n for s in ms.ALL_SPECS if s.kind == "histogram" for n in s.exported_series()}
    checked = set()
    for dash, title, expr in all_exprs() + variable_queries():
        for name, matchers in selectors(expr):
            if not name.startswith("ray_cbserve_") or name in histograms:
                continue
            assert any(matches(t, matchers) for t in started[name]), f"{dash} / {title}: no {name}{matchers} at 0"
            checked.add(name)
    assert checked == {s.exported for s in ms.ALL_SPECS if s.kind != "histogram"}
    rejected = {t["reason"] for t in started["ray_cbserve_request_rejected_total"]}
    assert rejected == set(ms.REJECT_REASONS) == {"queue_full", "rejected"}
    errors = {(t["route"], t["status"]) for t in started["ray_cbserve_http_requests_total"]}
    assert {("/v1/completions", "400"), ("/v1/chat/completions", "503")} <= errors
